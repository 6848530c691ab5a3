/*
 * The GPU block's host side: upload, workspace, the run, the benchmark
 * helpers. The only file of src/cuda that talks to the CUDA runtime API.
 *
 * Invariants:
 *  1. Every CUDA call is checked; a failure becomes a moe_status with a
 *     message naming the call (never printed here).
 *  2. Kernels never allocate: buffers come from the layer's workspace, which
 *     only grows (cudaMalloc here, outside any kernel).
 *  3. The scaling contract comes from moe_contract_applied (src/experts,
 *     the CPU drivers' own; a moe_variant's fault only in tests); the
 *     kernels only multiply what it says.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

extern "C" {
#include "core/core.h"
}
#include "moeaudit_cuda.h"
#include "moeaudit_variant.h"
#include "cuda/cuda_internal.cuh"
#include "experts/experts.h"
#include "router/router.h"
#include "cuda/cuda_pack.h"
#include "cuda/cuda_selftest.h"
#include "cuda/cuda_selftest_host.h"

#ifdef MOE_HAVE_CUBLAS
#include <cublas_v2.h>
#endif
#ifdef MOE_HAVE_CUBLASLT
#include <cublasLt.h>
#endif
#if defined(MOE_HAVE_CUBLAS) || defined(MOE_HAVE_CUBLASLT)
#include <dlfcn.h>
#include <mutex>
#endif

/* ---------------------------------------------------------------- cuBLAS */

/*
 * cuBLAS and cuBLASLt serve only the peak measurements of the bench (the
 * library's own kernels never call them), and mapping them costs every
 * process ~200 MB of RSS at start: so they are not linked but opened with
 * dlopen by the first measurement that needs them (issue #12). Only the
 * headers are used at build time, for the types; the function pointers
 * below are resolved once (std::call_once) and never change after.
 */
#define MOE_STR2(x) #x
#define MOE_STR(x) MOE_STR2(x)
#ifdef MOE_HAVE_CUBLAS
static struct {
    std::once_flag once;
    bool ok;
    char why[256];
    decltype(&cublasCreate_v2) create;
    decltype(&cublasSetStream_v2) set_stream;
    /* the C entry point (C++ also sees an inline overload taking a
     * cudaDataType compute type: name the signature) */
    cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,
                              const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *,
                              cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
    decltype(&cublasDestroy_v2) destroy;
} g_cublas;

/* The cuBLAS entry points, loaded on first use; false with err filled when
 * the library cannot be opened (the measurement then reports 0). */
static bool cublas_load(moe_error *err) {
    std::call_once(g_cublas.once, [] {
        const char *name = "libcublas.so." MOE_STR(CUBLAS_VER_MAJOR);
        void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        if (!h) h = dlopen("libcublas.so", RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            snprintf(g_cublas.why, sizeof g_cublas.why, "%s cannot be loaded: %s", name, e ? e : "?");
            return;
        }
        g_cublas.create = (decltype(g_cublas.create))dlsym(h, "cublasCreate_v2");
        g_cublas.set_stream = (decltype(g_cublas.set_stream))dlsym(h, "cublasSetStream_v2");
        g_cublas.gemm_ex = (decltype(g_cublas.gemm_ex))dlsym(h, "cublasGemmEx");
        g_cublas.destroy = (decltype(g_cublas.destroy))dlsym(h, "cublasDestroy_v2");
        g_cublas.ok = g_cublas.create && g_cublas.set_stream && g_cublas.gemm_ex && g_cublas.destroy;
        if (!g_cublas.ok) snprintf(g_cublas.why, sizeof g_cublas.why, "%s lacks a cuBLAS entry point", name);
    });
    if (!g_cublas.ok) moe_errf(err, MOE_ERR_UNSUPPORTED, "%s", g_cublas.why);
    return g_cublas.ok;
}
#endif

#ifdef MOE_HAVE_CUBLASLT
static struct {
    std::once_flag once;
    bool ok;
    char why[256];
    decltype(&cublasLtCreate) create;
    decltype(&cublasLtDestroy) destroy;
    decltype(&cublasLtMatmulDescCreate) desc_create;
    decltype(&cublasLtMatmulDescDestroy) desc_destroy;
    decltype(&cublasLtMatmulDescSetAttribute) desc_set;
    decltype(&cublasLtMatrixLayoutCreate) layout_create;
    decltype(&cublasLtMatrixLayoutDestroy) layout_destroy;
    decltype(&cublasLtMatmulPreferenceCreate) pref_create;
    decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy;
    decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set;
    decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic;
    decltype(&cublasLtMatmul) matmul;
} g_lt;

static bool cublaslt_load(moe_error *err) {
    std::call_once(g_lt.once, [] {
        const char *name = "libcublasLt.so." MOE_STR(CUBLAS_VER_MAJOR);
        void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        if (!h) h = dlopen("libcublasLt.so", RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            snprintf(g_lt.why, sizeof g_lt.why, "%s cannot be loaded: %s", name, e ? e : "?");
            return;
        }
#define MOE_LT_SYM(field, sym) g_lt.field = (decltype(g_lt.field))dlsym(h, #sym)
        MOE_LT_SYM(create, cublasLtCreate);
        MOE_LT_SYM(destroy, cublasLtDestroy);
        MOE_LT_SYM(desc_create, cublasLtMatmulDescCreate);
        MOE_LT_SYM(desc_destroy, cublasLtMatmulDescDestroy);
        MOE_LT_SYM(desc_set, cublasLtMatmulDescSetAttribute);
        MOE_LT_SYM(layout_create, cublasLtMatrixLayoutCreate);
        MOE_LT_SYM(layout_destroy, cublasLtMatrixLayoutDestroy);
        MOE_LT_SYM(pref_create, cublasLtMatmulPreferenceCreate);
        MOE_LT_SYM(pref_destroy, cublasLtMatmulPreferenceDestroy);
        MOE_LT_SYM(pref_set, cublasLtMatmulPreferenceSetAttribute);
        MOE_LT_SYM(heuristic, cublasLtMatmulAlgoGetHeuristic);
        MOE_LT_SYM(matmul, cublasLtMatmul);
#undef MOE_LT_SYM
        g_lt.ok = g_lt.create && g_lt.destroy && g_lt.desc_create && g_lt.desc_destroy && g_lt.desc_set &&
                  g_lt.layout_create && g_lt.layout_destroy && g_lt.pref_create && g_lt.pref_destroy &&
                  g_lt.pref_set && g_lt.heuristic && g_lt.matmul;
        if (!g_lt.ok) snprintf(g_lt.why, sizeof g_lt.why, "%s lacks a cuBLASLt entry point", name);
    });
    if (!g_lt.ok) moe_errf(err, MOE_ERR_UNSUPPORTED, "%s", g_lt.why);
    return g_lt.ok;
}
#endif

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t ce_ = (call);                                                                  \
        if (ce_ != cudaSuccess)                                                                    \
            return moe_errf(err, ce_ == cudaErrorMemoryAllocation ? MOE_ERR_NOMEM : MOE_ERR_IO,     \
                            "CUDA error in %s: %s", #call, cudaGetErrorString(ce_));               \
    } while (0)

struct moe_cuda_layer {
    moe_block_config cfg;
    int index;
    int E, K, H, Hp;
    int n_sm;             /* multiprocessors: the persistent wgmma grid */
    unsigned smallt = MOE_CUDA_SMALLT_PDL; /* moe_cuda_layer_set_smallt_launch */
    int wg_tokens = 0;    /* moe_cuda_layer_set_wg_tokens: 0 (the rule of wg_t256), 128 or 256 */
    cudaStream_t s;
    moe_cuda_path path;
    bool has_router;
    float *gate;          /* [E, Hp] fp32 */
    float *bias;          /* [E] or NULL */
    int32_t *tid2eid;     /* [vocab, K] or NULL */
    dweights w1, w3, w2;  /* routed experts */
    /* MXFP4 routed experts as FP8_BLOCK data (moe_k_mx_to_fp8, exact) for
     * the FP8 x FP8 GEMMs, when every tile fits (mxq); w1..w2 stay for the
     * GEMVs and the bf16-operand kernels. mxq_note: what the upload did
     * (moe_cuda_layer_note), empty for other formats. */
    dweights q1, q3, q2;
    bool mxq;
    char mxq_note[320];
    int I, Ip;
    bool has_shared;
    dweights sw1, sw3, sw2;
    int Ips;
    std::vector<void *> allocs;
    void *ws;
    size_t ws_size;
};

/* ------------------------------------------------------------- basics */

extern "C" int moe_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" moe_status moe_cuda_device_info(char *buf, size_t n, moe_error *err) {
    if (moe_cuda_device_count() == 0) return moe_errf(err, MOE_ERR_UNSUPPORTED, "no CUDA device is present");
    int d = 0;
    CK(cudaGetDevice(&d));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, d));
    snprintf(buf, n, "%s (sm_%d%d, %d SMs, %.0f GiB, L2 %d MiB)", p.name, p.major, p.minor, p.multiProcessorCount,
             (double)p.totalGlobalMem / (1u << 30), p.l2CacheSize >> 20);
    return MOE_OK;
}

static moe_status dev_alloc(moe_cuda_layer *g, size_t bytes, void **out, moe_error *err) {
    *out = NULL;
    if (bytes == 0) return MOE_OK;
    CK(cudaMalloc(out, bytes));
    g->allocs.push_back(*out);
    return MOE_OK;
}

extern "C" void moe_cuda_layer_free(moe_cuda_layer *g) {
    if (!g) return;
    for (void *p : g->allocs) cudaFree(p);
    if (g->ws) cudaFree(g->ws);
    if (g->s) cudaStreamDestroy(g->s);
    delete g;
}

extern "C" void moe_cuda_layer_set_path(moe_cuda_layer *g, moe_cuda_path p) { g->path = p; }
extern "C" void moe_cuda_layer_set_smallt_launch(moe_cuda_layer *g, unsigned flags) {
    g->smallt = flags & (MOE_CUDA_SMALLT_PDL | MOE_CUDA_SMALLT_L2);
}
extern "C" void moe_cuda_layer_set_wg_tokens(moe_cuda_layer *g, int tokens) {
    g->wg_tokens = tokens == 128 || tokens == 256 ? tokens : 0;
}

static int dfmt(moe_wfmt f) {
    switch (f) {
    case MOE_WFMT_FP8_BLOCK: return DF_FP8;
    case MOE_WFMT_MXFP4: return DF_MXFP4;
    case MOE_WFMT_NVFP4: return DF_NVFP4;
    default: return DF_BF16;
    }
}

static moe_status new_layer(moe_cuda_layer **out, moe_error *err) {
    if (moe_cuda_device_count() == 0) return moe_errf(err, MOE_ERR_UNSUPPORTED, "no CUDA device is present");
    int d = 0;
    CK(cudaGetDevice(&d));
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, d));
    if (p.major != 9)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "the GPU kernels are built for sm_90a (Hopper); device %s is sm_%d%d",
                        p.name, p.major, p.minor);
    moe_cuda_layer *g = new moe_cuda_layer();
    g->path = MOE_CUDA_PATH_AUTO;
    g->n_sm = p.multiProcessorCount;
    cudaError_t ce = cudaStreamCreateWithFlags(&g->s, cudaStreamNonBlocking);
    if (ce != cudaSuccess) {
        delete g;
        return moe_errf(err, MOE_ERR_IO, "CUDA error in cudaStreamCreate: %s", cudaGetErrorString(ce));
    }
    *out = g;
    return MOE_OK;
}

/* A family's device layout from its packing plan (pointers left NULL):
 * experts 256-byte aligned apart. */
static void plan_layout(const moe_cuda_pack &p, dweights *d) {
    memset(d, 0, sizeof *d);
    d->fmt = dfmt(p.fmt);
    d->rows_p = p.rows_p;
    d->kp = p.kp;
    d->dstride = (long long)((p.dbytes + 255) / 256 * 256);
    d->sstride = (long long)((p.sbytes + 255) / 256 * 256);
}

/* Upload one projection family: n weights (w[i * stride_w]) into dweights. */
static moe_status upload_family(moe_cuda_layer *g, const moe_weight *w, int n, dweights *d, moe_error *err) {
    moe_cuda_pack p;
    moe_status st = moe_cuda_pack_plan(w, n, &p, err);
    if (st != MOE_OK) return st;
    plan_layout(p, d);
    d->n = n;
    void *data = NULL, *scale = NULL, *s2 = NULL;
    if ((st = dev_alloc(g, (size_t)d->dstride * n, &data, err)) != MOE_OK) return st;
    if ((st = dev_alloc(g, (size_t)d->sstride * n, &scale, err)) != MOE_OK) return st;
    if ((st = dev_alloc(g, sizeof(float) * n, &s2, err)) != MOE_OK) return st;
    std::vector<uint8_t> hd(p.dbytes), hs(p.sbytes + 1);
    std::vector<float> h2(n);
    for (int i = 0; i < n; i++) {
        moe_cuda_pack_one(&p, &w[i], hd.data(), p.sbytes ? hs.data() : NULL, &h2[i]);
        CK(cudaMemcpy((uint8_t *)data + (size_t)d->dstride * i, hd.data(), p.dbytes, cudaMemcpyHostToDevice));
        if (p.sbytes)
            CK(cudaMemcpy((uint8_t *)scale + (size_t)d->sstride * i, hs.data(), p.sbytes, cudaMemcpyHostToDevice));
    }
    CK(cudaMemcpy(s2, h2.data(), sizeof(float) * n, cudaMemcpyHostToDevice));
    d->data = (const uint8_t *)data;
    d->scale = (const uint8_t *)scale;
    d->scale2 = (const float *)s2;
    return MOE_OK;
}

/* The FP8_BLOCK twin's shape of an MXFP4 projection (data and scales not
 * yet placed): E4M3 codes [n][rows_p][kp], f32 128 x 128 tile scales. */
static dweights mx_twin(const dweights &src) {
    dweights d = src;
    const long long kb = (d.kp + 127) / 128;
    d.fmt = DF_FP8;
    d.dstride = ((long long)d.rows_p * d.kp + 255) / 256 * 256;
    d.sstride = ((long long)(d.rows_p / 128) * kb * 4 + 255) / 256 * 256;
    d.data = nullptr;
    d.scale = nullptr;
    return d;
}

/* MXFP4 routed experts (all three projections): their FP8_BLOCK twins
 * q1, q3, q2 by moe_k_mx_to_fp8 when every 128 x 128 tile of every expert
 * fits the E4M3 window (then mxq), else none: the layer keeps the
 * bf16-operand kernels for FP8 activations and mxq_note names the first
 * tile that did not fit (L: its tensor names; NULL: the bench's random
 * layer). Device memory: 2x the FP4 data more while the twins exist. No
 * twins, and a note that says why, when MOE_CUDA_MXQ is "0" (a layer that
 * serves bf16 activations only, or whose device has no room to spare) or
 * when the device has not the memory for them: the layer still works, its
 * FP8 activations on the bf16-operand kernels (within the same tolerance of
 * the reference; other bits than the twins' path). */
static moe_status mx_transcode(moe_cuda_layer *g, const moe_layer *L, moe_error *err) {
    g->mxq = false;
    g->mxq_note[0] = 0;
    if (g->w1.fmt != DF_MXFP4 || g->w3.fmt != DF_MXFP4 || g->w2.fmt != DF_MXFP4) return MOE_OK;
    const char *env = getenv("MOE_CUDA_MXQ");
    if (env && strcmp(env, "0") == 0) {
        snprintf(g->mxq_note, sizeof g->mxq_note,
                 "mxfp4 x fp8 stays on the bf16-operand kernels: MOE_CUDA_MXQ=0 (no E4M3 twins of the experts)");
        return MOE_OK;
    }
    const dweights *src[3] = {&g->w1, &g->w3, &g->w2};
    dweights *dst[3] = {&g->q1, &g->q3, &g->q2};
    void *buf[6] = {NULL, NULL, NULL, NULL, NULL, NULL}, *dbad = NULL;
    int bad[6] = {0, 0x7FFFFFFF, 0, 0x7FFFFFFF, 0, 0x7FFFFFFF};
    dweights tw[3];
    size_t need = 0; /* the twins' bytes */
    for (int f = 0; f < 3; f++) {
        tw[f] = mx_twin(*src[f]);
        need += (size_t)(tw[f].dstride + tw[f].sstride) * (size_t)tw[f].n;
    }
    cudaError_t ce = cudaMalloc(&dbad, sizeof bad);
    if (ce == cudaSuccess) ce = cudaMemcpy(dbad, bad, sizeof bad, cudaMemcpyHostToDevice);
    for (int f = 0; f < 3 && ce == cudaSuccess; f++) {
        dweights d = tw[f];
        ce = cudaMalloc(&buf[2 * f], (size_t)d.dstride * d.n);
        if (ce == cudaSuccess) ce = cudaMalloc(&buf[2 * f + 1], (size_t)d.sstride * d.n);
        if (ce != cudaSuccess) break;
        d.data = (const uint8_t *)buf[2 * f];
        d.scale = (const uint8_t *)buf[2 * f + 1];
        *dst[f] = d;
        ce = moe_k_mx_to_fp8(src[f], &d, (int *)dbad + 2 * f, g->s);
    }
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(g->s);
    if (ce == cudaSuccess) ce = cudaMemcpy(bad, dbad, sizeof bad, cudaMemcpyDeviceToHost);
    cudaFree(dbad);
    int worst = -1;
    for (int f = 0; f < 3 && ce == cudaSuccess; f++)
        if (bad[2 * f] && worst < 0) worst = f;
    if (ce != cudaSuccess || worst >= 0) {
        for (void *p : buf) cudaFree(p);
        memset(&g->q1, 0, sizeof g->q1);
        memset(&g->q3, 0, sizeof g->q3);
        memset(&g->q2, 0, sizeof g->q2);
    }
    if (ce == cudaErrorMemoryAllocation) {
        /* only the twins' own cudaMalloc fails this way: nothing of the
         * layer is lost, it runs without them */
        (void)cudaGetLastError();
        size_t fr = 0, tot = 0;
        (void)cudaMemGetInfo(&fr, &tot);
        snprintf(g->mxq_note, sizeof g->mxq_note,
                 "mxfp4 x fp8 stays on the bf16-operand kernels: the E4M3 twins of the experts (%.2f GiB) do not fit "
                 "in device memory (%.2f GiB free)",
                 (double)need / (double)(1u << 30), (double)fr / (double)(1u << 30));
        return MOE_OK;
    }
    if (ce != cudaSuccess)
        return moe_errf(err, MOE_ERR_IO, "CUDA error transcoding MXFP4 experts to E4M3: %s", cudaGetErrorString(ce));
    if (worst >= 0) {
        static const char *proj[3] = {"w1", "w3", "w2"};
        const dweights &w = *src[worst];
        const int kb = (w.kp + 127) / 128, tr = w.rows_p / 128, t = bad[2 * worst + 1];
        const int e = t / (tr * kb), r = t / kb % tr, c = t % kb;
        const moe_weight *mw = L ? (worst == 0 ? &L->w1[e] : worst == 1 ? &L->w3[e] : &L->w2[e]) : NULL;
        snprintf(g->mxq_note, sizeof g->mxq_note,
                 "mxfp4 x fp8 stays on the bf16-operand kernels: %d tile(s) of %s are not E4M3 with one "
                 "power-of-two scale, the first %s rows %d.., columns %d.. (E8M0 codes spanning more than 14, "
                 "or a NaN scale)",
                 bad[2 * worst], proj[worst], mw && mw->name ? mw->name : proj[worst], 128 * r, 128 * c);
        return MOE_OK;
    }
    for (void *p : buf) g->allocs.push_back(p);
    g->mxq = true;
    snprintf(g->mxq_note, sizeof g->mxq_note,
             "mxfp4 experts transcoded to E4M3 with power-of-two 128 x 128 tile scales at upload, exactly (%.2f GiB "
             "more on the device): fp8 activations multiply them on the FP8 tensor cores",
             (double)need / (double)(1u << 30));
    return MOE_OK;
}

extern "C" const char *moe_cuda_layer_note(const moe_cuda_layer *g) { return g->mxq_note[0] ? g->mxq_note : NULL; }

extern "C" moe_status moe_cuda_layer_upload(const moe_layer *L, moe_cuda_layer **out, moe_error *err) {
    *out = NULL;
    const moe_block_config *c = &L->cfg;
    if (c->kind == MOE_LAYER_DENSE) return moe_errf(err, MOE_ERR_ARG, "layer %d is dense", L->index);
    if (c->top_k < 1 || c->top_k + 1 > MOE_CUDA_MAX_COLS)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "the GPU path takes top_k up to %d (layer %d has %d)",
                        MOE_CUDA_MAX_COLS - 1, L->index, c->top_k);
    if (c->n_group > 64 || c->n_experts > 4096)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "the GPU router takes up to 64 groups and 4096 experts");
    moe_cuda_layer *g = NULL;
    moe_status st = new_layer(&g, err);
    if (st != MOE_OK) return st;
    g->cfg = *c;
    g->index = L->index;
    g->E = c->n_experts;
    g->K = c->top_k;
    g->H = c->hidden;
    g->Hp = (c->hidden + 63) / 64 * 64;
    g->I = c->inter;
    g->has_router = true;
#define TRY(x) do { if ((st = (x)) != MOE_OK) { moe_cuda_layer_free(g); return st; } } while (0)
    /* router */
    {
        std::vector<float> G((size_t)g->E * g->Hp, 0.0f), row(g->H);
        for (int e = 0; e < g->E; e++) {
            moe_weight_row_f32(&L->gate, e, row.data());
            memcpy(&G[(size_t)e * g->Hp], row.data(), sizeof(float) * g->H);
        }
        void *p = NULL;
        TRY(dev_alloc(g, G.size() * sizeof(float), &p, err));
        g->gate = (float *)p;
        cudaError_t ce = cudaMemcpy(p, G.data(), G.size() * sizeof(float), cudaMemcpyHostToDevice);
        if (ce != cudaSuccess) { moe_cuda_layer_free(g); return moe_errf(err, MOE_ERR_IO, "CUDA error: %s", cudaGetErrorString(ce)); }
        if (L->bias) {
            std::vector<float> b(g->E);
            for (int e = 0; e < g->E; e++) b[e] = (float)L->bias[e];
            TRY(dev_alloc(g, b.size() * sizeof(float), &p, err));
            g->bias = (float *)p;
            cudaMemcpy(p, b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice);
        }
        if (c->kind == MOE_LAYER_HASH) {
            size_t n = (size_t)c->vocab * g->K;
            TRY(dev_alloc(g, n * sizeof(int32_t), &p, err));
            g->tid2eid = (int32_t *)p;
            cudaMemcpy(p, L->tid2eid, n * sizeof(int32_t), cudaMemcpyHostToDevice);
        }
    }
    TRY(upload_family(g, L->w1, g->E, &g->w1, err));
    TRY(upload_family(g, L->w3, g->E, &g->w3, err));
    TRY(upload_family(g, L->w2, g->E, &g->w2, err));
    if (g->w1.fmt != g->w3.fmt || g->w1.kp != g->Hp || g->w2.kp != (g->I + 63) / 64 * 64) {
        moe_cuda_layer_free(g);
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "layer %d: gate and up projections need one format on the GPU",
                        L->index);
    }
    g->Ip = g->w2.kp;
    TRY(mx_transcode(g, L, err));
    g->has_shared = c->shared_inter > 0 && L->sw1.rows > 0;
    if (g->has_shared) {
        TRY(upload_family(g, &L->sw1, 1, &g->sw1, err));
        TRY(upload_family(g, &L->sw3, 1, &g->sw3, err));
        TRY(upload_family(g, &L->sw2, 1, &g->sw2, err));
        g->Ips = g->sw2.kp;
        if (g->sw1.fmt != g->sw3.fmt) {
            moe_cuda_layer_free(g);
            return moe_errf(err, MOE_ERR_UNSUPPORTED, "layer %d: shared gate and up need one format", L->index);
        }
    }
    cudaError_t ce = cudaDeviceSynchronize();
    if (ce != cudaSuccess) { moe_cuda_layer_free(g); return moe_errf(err, MOE_ERR_IO, "CUDA error after upload: %s", cudaGetErrorString(ce)); }
#undef TRY
    *out = g;
    return MOE_OK;
}

extern "C" moe_status moe_cuda_layer_random(moe_wfmt fmt, int hidden, int inter, int n_experts, int top_k,
                                            uint64_t seed, moe_cuda_layer **out, moe_error *err) {
    *out = NULL;
    if (top_k < 1 || top_k > MOE_CUDA_MAX_COLS || n_experts < top_k)
        return moe_errf(err, MOE_ERR_ARG, "bad expert counts E %d K %d", n_experts, top_k);
    moe_cuda_layer *g = NULL;
    moe_status st = new_layer(&g, err);
    if (st != MOE_OK) return st;
    g->E = n_experts;
    g->K = top_k;
    g->H = hidden;
    g->Hp = (hidden + 63) / 64 * 64;
    g->I = inter;
    g->cfg.hidden = hidden;
    g->cfg.inter = inter;
    g->cfg.n_experts = n_experts;
    g->cfg.top_k = top_k;
    g->cfg.scaling = 1.0;
    moe_weight w[2];
    memset(w, 0, sizeof w);
    w[0].fmt = fmt; w[0].rows = inter; w[0].cols = hidden; w[0].name = "random w1/w3";
    w[1].fmt = fmt; w[1].rows = hidden; w[1].cols = inter; w[1].name = "random w2";
    dweights *fam[3] = {&g->w1, &g->w3, &g->w2};
    for (int f = 0; f < 3; f++) {
        moe_cuda_pack p;
        st = moe_cuda_pack_plan(&w[f == 2], 1, &p, err);
        if (st != MOE_OK) { moe_cuda_layer_free(g); return st; }
        dweights *d = fam[f];
        plan_layout(p, d);
        d->n = n_experts;
        void *data = NULL, *scale = NULL, *s2 = NULL;
        if ((st = dev_alloc(g, (size_t)d->dstride * n_experts, &data, err)) != MOE_OK ||
            (st = dev_alloc(g, (size_t)d->sstride * n_experts + 256, &scale, err)) != MOE_OK ||
            (st = dev_alloc(g, sizeof(float) * n_experts, &s2, err)) != MOE_OK) {
            moe_cuda_layer_free(g);
            return st;
        }
        int dk = d->fmt == DF_FP8 ? 1 : d->fmt == DF_BF16 ? 2 : 0;
        cudaError_t ce = moe_k_fill_random((uint8_t *)data, (size_t)d->dstride * n_experts, seed * 3 + f, dk, g->s);
        if (ce == cudaSuccess && d->fmt == DF_MXFP4)
            ce = moe_k_fill_random((uint8_t *)scale, (size_t)d->sstride * n_experts, seed * 7 + f, 3, g->s);
        if (ce == cudaSuccess && d->fmt == DF_NVFP4)
            ce = moe_k_fill_random((uint8_t *)scale, (size_t)d->sstride * n_experts, seed * 7 + f, 4, g->s);
        if (ce == cudaSuccess && d->fmt == DF_FP8)
            ce = moe_k_fill_f32((float *)scale, (size_t)d->sstride * n_experts / 4, 0x1p-8f, g->s);
        if (ce == cudaSuccess)
            ce = moe_k_fill_f32((float *)s2, (size_t)n_experts, d->fmt == DF_NVFP4 ? 1.0f / 2688.0f : 1.0f, g->s);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(g->s);
        if (ce != cudaSuccess) {
            moe_cuda_layer_free(g);
            return moe_errf(err, MOE_ERR_IO, "CUDA error filling random weights: %s", cudaGetErrorString(ce));
        }
        d->data = (const uint8_t *)data;
        d->scale = (const uint8_t *)scale;
        d->scale2 = (const float *)s2;
    }
    g->Ip = g->w2.kp;
    if ((st = mx_transcode(g, NULL, err)) != MOE_OK) {
        moe_cuda_layer_free(g);
        return st;
    }
    *out = g;
    return MOE_OK;
}

/* ---------------------------------------------------------- workspace */

struct wsl {
    float *Xf;            /* [T, Hp] */
    __nv_bfloat16 *Xb;    /* [T, Hp] */
    float *logits;        /* [T, E] */
    float *work;          /* [T, 2E] */
    int32_t *ids;         /* [T, C] */
    float *tw, *ew;       /* [T, C] */
    int64_t *tok;         /* [T] */
    int32_t *perm;        /* [T * K] */
    int32_t *offsets;     /* [E + 1] */
    mma_tile *tiles;      /* [max_tiles] */
    int32_t *n_tiles;     /* [1] */
    int32_t *sort_cnt;    /* [moe_k_sort_scratch(T, K, E)] */
    float *Hf;            /* [T * K, Ip] */
    __nv_bfloat16 *Hb;    /* [T * K, Ip] */
    __nv_bfloat16 *Xs;    /* [T * K, Hp] activation rows in sorted order (TMA gate/up), or NULL */
    /* the FP8 x FP8 GEMMs (qg_able), else NULL: E4M3 codes and their
     * scales per row per 128 columns (KBh = ceil(Hp / 128), KBi = ceil(Ip / 128)) */
    uint8_t *Xq;          /* [T, Hp] */
    float *Xqsc;          /* [T, KBh] */
    uint8_t *Xqs;         /* [T * K, Hp] sorted order */
    float *Xqss;          /* [T * K, KBh] */
    uint8_t *Hq;          /* [T * K, Ip] */
    float *Hqs;           /* [T * K, KBi] */
    float *Y;             /* [T * C, Yp] */
    float *Hsf;           /* [T, Ips] */
    __nv_bfloat16 *Hsb;   /* [T, Ips] */
    float *Ysh;           /* [T, Ysp] */
    float *routed, *shared, *out; /* [T, H] */
    size_t total;
};

static void carve(void **p, size_t bytes, uint8_t *base, size_t *off) {
    *p = base ? base + *off : NULL;
    *off += (bytes + 255) / 256 * 256;
}

static size_t max_tiles_for(int64_t T, int K, int E, int bm = MOE_CUDA_MMA_BM) {
    return (size_t)((T * K + bm - 1) / bm) + (size_t)E;
}

static bool gathers(const moe_cuda_layer *g, int64_t T);
static bool qg_able(const moe_cuda_layer *g, int64_t T);

static wsl layout(const moe_cuda_layer *g, int64_t T, int C, uint8_t *base) {
    wsl w;
    memset(&w, 0, sizeof w);
    size_t o = 0, t = (size_t)T, E = (size_t)g->E, K = (size_t)g->K, Cs = (size_t)C;
    size_t Yp = (size_t)g->w2.rows_p;
    carve((void **)&w.Xf, t * g->Hp * 4, base, &o);
    carve((void **)&w.Xb, t * g->Hp * 2, base, &o);
    carve((void **)&w.logits, t * E * 4, base, &o);
    carve((void **)&w.work, t * 2 * E * 4, base, &o);
    carve((void **)&w.ids, t * Cs * 4, base, &o);
    carve((void **)&w.tw, t * Cs * 4, base, &o);
    carve((void **)&w.ew, t * Cs * 4, base, &o);
    carve((void **)&w.tok, t * 8, base, &o);
    carve((void **)&w.perm, t * K * 4, base, &o);
    carve((void **)&w.offsets, (E + 1) * 4, base, &o);
    carve((void **)&w.tiles, max_tiles_for(T, g->K, g->E, MOE_CUDA_GRP_NT) * sizeof(mma_tile), base, &o);
    carve((void **)&w.n_tiles, 4, base, &o);
    carve((void **)&w.sort_cnt, moe_k_sort_scratch((int)T, g->K, g->E) * 4, base, &o);
    carve((void **)&w.Hf, t * K * g->Ip * 4, base, &o);
    carve((void **)&w.Hb, t * K * g->Ip * 2, base, &o);
    if (gathers(g, T)) carve((void **)&w.Xs, t * K * g->Hp * 2, base, &o);
    if (qg_able(g, T)) {
        size_t kbh = (size_t)(g->Hp + 127) / 128, kbi = (size_t)(g->Ip + 127) / 128;
        carve((void **)&w.Xq, t * g->Hp, base, &o);
        carve((void **)&w.Xqsc, t * kbh * 4, base, &o);
        carve((void **)&w.Xqs, t * K * g->Hp, base, &o);
        carve((void **)&w.Xqss, t * K * kbh * 4, base, &o);
        carve((void **)&w.Hq, t * K * g->Ip, base, &o);
        carve((void **)&w.Hqs, t * K * kbi * 4, base, &o);
    }
    carve((void **)&w.Y, t * Cs * Yp * 4, base, &o);
    if (g->has_shared) {
        carve((void **)&w.Hsf, t * g->Ips * 4, base, &o);
        carve((void **)&w.Hsb, t * g->Ips * 2, base, &o);
        carve((void **)&w.Ysh, t * g->sw2.rows_p * 4, base, &o);
    }
    carve((void **)&w.routed, t * g->H * 4, base, &o);
    carve((void **)&w.shared, t * g->H * 4, base, &o);
    carve((void **)&w.out, t * g->H * 4, base, &o);
    w.total = o;
    return w;
}

static int cols_for(const moe_cuda_layer *g, const moe_run_opts *o) {
    return g->K + (o && o->fuse_shared && g->has_shared ? 1 : 0);
}

extern "C" size_t moe_cuda_workspace_size(const moe_cuda_layer *g, int64_t T, const moe_run_opts *opts) {
    return layout(g, T, cols_for(g, opts), NULL).total;
}

static moe_status ensure_ws(moe_cuda_layer *g, size_t bytes, moe_error *err) {
    if (g->ws_size >= bytes) return MOE_OK;
    if (g->ws) {
        CK(cudaStreamSynchronize(g->s));
        CK(cudaFree(g->ws));
        g->ws = NULL;
        g->ws_size = 0;
    }
    CK(cudaMalloc(&g->ws, bytes));
    g->ws_size = bytes;
    return MOE_OK;
}

/* ------------------------------------------------------------ the run */

static int act_code(moe_act_prec a) {
    return a == MOE_ACT_FP8 ? ACT_FP8_POW2 : a == MOE_ACT_FP8_F32SCALE ? ACT_FP8_F32 : ACT_BF16;
}

/* Up to this many tokens the GEMV kernels win (bench: docs/performance-cuda.md);
 * for BF16 weights the TMA wgmma GEMM is faster from T = 8 (H200, one call:
 * T = 8 / 16 / 32 wgmma 0.661 / 1.144 / 1.759 ms, GEMV 0.700 / 1.346 /
 * 2.619), for FP8 (bf16 activations) from T = 64 (2.907 against 3.469; at 32 the GEMV 1.747
 * against 2.073). */
#define MOE_CUDA_GEMV_MAX_T 32
#define MOE_CUDA_GEMV_MAX_T_BF16 7
/* FP8 weights with FP8 activations: the FP8 tensor-core GEMMs win from
 * T = 8, the smallest T measured (H200, one call: T = 8 / 16 / 32 / 64
 * FP8 x FP8 0.416 / 0.653 / 1.009 / 1.414 ms, GEMV 0.498 / 0.975 / 1.904 /
 * 3.784; docs/performance-cuda.md, seventh session); below 8 the GEMV
 * stays (not measured against it). */
#define MOE_CUDA_GEMV_MAX_T_QG 7
/* FP4 weights: the per-assignment GEMV up to GEMV_TC_MAX_T tokens, the
 * grouped GEMV up to GRP_MAX_T (MXFP4) / GRP_MAX_T_NV (NVFP4), the wgmma
 * GEMM above (crossovers measured on the H200: MXFP4 grouped 2.58 / 4.59 ms
 * at T = 128 / 256 against wgmma 3.69 / 3.82, equal near T = 210; NVFP4
 * wgmma 4.86 / 5.06 against a grouped GEMV ~5% slower than MXFP4's:
 * docs/performance-cuda.md). */
#define MOE_CUDA_GEMV_TC_MAX_T 8
/* MXFP4 weights transcoded to E4M3 (mxq) with FP8 activations: the FP8 x
 * FP8 GEMMs from this T under AUTO, below it the FP4 GEMVs above, which
 * read half the bytes (H200, one call, forced paths --path wgmma / grouped:
 * T = 16 / 24 / 32 / 48 / 64 FP8 x FP8 0.699 / 0.906 / 1.093 / 1.354 /
 * 1.507 ms, grouped GEMV 0.651 / 0.880 / 1.119 / 1.483 / 1.804;
 * docs/performance-cuda.md, eighth session). */
#define MOE_CUDA_MXQ_MIN_T 32
#define MOE_CUDA_GRP_MAX_T 192
#define MOE_CUDA_GRP_MAX_T_NV 256
/* K steps (128 columns, 2 KB of gate/up codes a warp) between the
 * per-assignment FP4 GEMVs' L2 prefetch (MOE_CUDA_SMALLT_L2) and their
 * register loads: 4 puts ~5 steps (10 KB) a warp in flight, ~15 MB over
 * the 1536 gate/up warps at T = 1, well inside the L2. Measured slower than
 * no prefetch at T = 1 (docs/performance-cuda.md, seventh session); no
 * other depth was measured. */
#define MOE_CUDA_PF_STEPS 4

static bool fp4(const dweights &w) { return w.fmt == DF_MXFP4 || w.fmt == DF_NVFP4; }

/* act: the call's activation rounding; MXFP4 weights transcoded for the
 * FP8 x FP8 GEMMs (mxq) with FP8 activations take those instead under
 * AUTO from T = MOE_CUDA_MXQ_MIN_T. */
static bool use_grouped(const moe_cuda_layer *g, int64_t T, int act = ACT_BF16) {
    if (!fp4(g->w1)) return false;
    if (g->path == MOE_CUDA_PATH_GROUPED) return true;
    if (g->mxq && act != ACT_BF16 && T >= MOE_CUDA_MXQ_MIN_T) return false;
    int64_t hi = g->w1.fmt == DF_NVFP4 ? MOE_CUDA_GRP_MAX_T_NV : MOE_CUDA_GRP_MAX_T;
    return g->path == MOE_CUDA_PATH_AUTO && T > MOE_CUDA_GEMV_TC_MAX_T && T <= hi;
}

static bool fp8_all(const moe_cuda_layer *g) {
    return g->w1.fmt == DF_FP8 && g->w3.fmt == DF_FP8 && g->w2.fmt == DF_FP8;
}

/* act: the call's activation rounding (ACT_*): FP8 weights with FP8
 * activations leave the GEMV sooner (MOE_CUDA_GEMV_MAX_T_QG). */
static bool use_gemv(const moe_cuda_layer *g, int64_t T, int act = ACT_BF16) {
    if (g->path == MOE_CUDA_PATH_GEMV || g->path == MOE_CUDA_PATH_GEMV_F32) return true;
    if (g->path == MOE_CUDA_PATH_GROUPED) return !fp4(g->w1);
    if (g->path == MOE_CUDA_PATH_MMA || g->path == MOE_CUDA_PATH_WGMMA || g->path == MOE_CUDA_PATH_WGMMA_CP ||
        g->path == MOE_CUDA_PATH_WGMMA_PD || g->path == MOE_CUDA_PATH_WGMMA_BF16)
        return false;
    if (fp8_all(g) && act != ACT_BF16) return T <= MOE_CUDA_GEMV_MAX_T_QG;
    if (fp4(g->w1)) return T <= MOE_CUDA_GEMV_TC_MAX_T;
    return T <= (g->w1.fmt == DF_BF16 ? MOE_CUDA_GEMV_MAX_T_BF16 : MOE_CUDA_GEMV_MAX_T);
}

/* The grouped GEMMs run on wgmma (cuda_wgmma.cu) when WGMMA or WGMMA_CP is
 * forced and under AUTO for every format, on mma.sync (cuda_gemm.cu) only
 * when MMA is forced. BF16 weights took mma.sync under AUTO while the wgmma
 * producer copied their 48 KB per k step by cp.async (wgmma 5.33 / 5.80 /
 * 12.25 ms at T = 128 / 1024 / 8192 against mma.sync 4.14 / 4.66 / 10.78);
 * with the weight tiles by TMA the wgmma kernel took 2.87 / 3.23 / 7.03 ms
 * (H200, docs/performance-cuda.md). */
static bool use_wgmma(const moe_cuda_layer *g, const dweights &w) {
    (void)w;
    if (g->path == MOE_CUDA_PATH_WGMMA || g->path == MOE_CUDA_PATH_WGMMA_CP ||
        g->path == MOE_CUDA_PATH_WGMMA_PD || g->path == MOE_CUDA_PATH_WGMMA_BF16) return true;
    return g->path == MOE_CUDA_PATH_AUTO;
}

/* The wgmma kernels load their weight tiles (and down's activation tiles)
 * by TMA except on WGMMA_CP, the earlier all-cp.async producer kept for
 * comparison (same results bit for bit). */
static bool wg_tma(const moe_cuda_layer *g) { return g->path != MOE_CUDA_PATH_WGMMA_CP; }

/* FP8 / FP4 weights are decoded by the consumer warpgroups (beside their
 * MMAs) except on WGMMA_PD, the fifth session's producer-warpgroup decode,
 * and WGMMA_CP (cp.async loads, producer decode), both kept for comparison. */
static bool wg_cdec(const moe_cuda_layer *g) {
    return g->path != MOE_CUDA_PATH_WGMMA_CP && g->path != MOE_CUDA_PATH_WGMMA_PD;
}

/* The routed gate/up takes its activation rows pre-gathered into sorted
 * order (ws.Xs, one pass: T K Hp bf16) when it runs on the TMA wgmma path. */
static bool gathers(const moe_cuda_layer *g, int64_t T) {
    return !use_gemv(g, T) && !use_grouped(g, T) && use_wgmma(g, g->w1) && wg_tma(g);
}

/* The bf16-operand wgmma GEMMs (all three projections of the set, routed or
 * shared, in one format; FP8 / FP4 with the consumers' decode, path AUTO or
 * WGMMA) take the 256-token tile (moe_k_gateup_wg's
 * t256: tiles of MOE_CUDA_WG_BM2 positions x 128 weight rows) on the TMA
 * path when moe_cuda_layer_set_wg_tokens asks for 256, or under its rule
 * (0): the set's n_pos positions average at least MOE_CUDA_WG_T256_MIN per
 * expert (E experts; the shared expert: E = 1). Why: at 128 tokens an
 * expert with 129-256 positions reads (and FP8 / FP4 decode) its weights
 * twice; BF16 weights are DRAM-bound there (T = 8192: 17.42 GB read for 8.6
 * GB of gate/up weights at 85% of DRAM peak). Measured (H200, V4-Flash,
 * docs/performance-cuda.md): faster at T = 6144 and 8192 (144 and 192
 * positions per expert) in every format, slower at T <= 4096 (96). The same
 * bits either way (tested): the rule keeps a token's output independent of
 * its batch. */
#define MOE_CUDA_WG_T256_MIN 128
static bool wg_t256(const moe_cuda_layer *g, const dweights &a, const dweights &b, const dweights &c, int64_t n_pos,
                    int E) {
    if (b.fmt != a.fmt || c.fmt != a.fmt || !use_wgmma(g, a) || !wg_tma(g)) return false;
    if (a.fmt != DF_BF16 && !wg_cdec(g)) return false; /* FP8 / FP4: the consumers' decode only */
    if (g->wg_tokens) return g->wg_tokens == 256;
    return n_pos >= (int64_t)MOE_CUDA_WG_T256_MIN * E;
}

/* FP8 weights (all three projections), and MXFP4 weights transcoded to
 * them at upload (mxq: the same values, mx_transcode), with FP8
 * activations run on the FP8
 * tensor cores (cuda_qgmma.cu) wherever AUTO or WGMMA takes the wgmma
 * GEMMs; WGMMA_BF16, WGMMA_PD and WGMMA_CP keep the bf16-operand kernels.
 * AUTO's crossover against them: docs/performance-cuda.md, seventh
 * session. qg_able: the workspace holds its buffers (whatever the
 * activations of the call). */
static bool qg_able(const moe_cuda_layer *g, int64_t T) {
    return (fp8_all(g) || (g->mxq && (g->path == MOE_CUDA_PATH_WGMMA || T >= MOE_CUDA_MXQ_MIN_T))) &&
           (g->path == MOE_CUDA_PATH_AUTO || g->path == MOE_CUDA_PATH_WGMMA) &&
           !use_gemv(g, T, ACT_FP8_POW2);
}
static bool use_qgmma(const moe_cuda_layer *g, int64_t T, int act) { return act != ACT_BF16 && qg_able(g, T); }

static int act_code(moe_act_prec a);

extern "C" const char *moe_cuda_layer_operands(const moe_cuda_layer *g, int64_t T, moe_act_prec act) {
    if (!use_qgmma(g, T, act_code(act))) return "bf16";
    return g->mxq ? "fp8 (mxfp4 transcoded)" : "fp8";
}

extern "C" int moe_cuda_layer_wg_tokens_at(const moe_cuda_layer *g, int64_t T, moe_act_prec act) {
    const int a = act_code(act);
    if (use_gemv(g, T, a) || use_grouped(g, T, a) || use_qgmma(g, T, a) || !use_wgmma(g, g->w1)) return 0;
    return wg_t256(g, g->w1, g->w3, g->w2, T * g->K, g->E) ? 256 : 128;
}

/* FP4 weights take the tensor-core GEMVs (cuda_gemv_tc.cu) unless the
 * path is GEMV_F32 (the comparison in the tests and the bench). */
static bool gemv_tc(const moe_cuda_layer *g, const dweights &w) {
    return g->path != MOE_CUDA_PATH_GEMV_F32 && fp4(w);
}

/* The expert stages on device inputs ws.Xb, ws.ids, ws.tw (C columns). */
static moe_status run_experts(moe_cuda_layer *g, const wsl &w, int64_t T, int C, bool fused, int act,
                              float runner_mult, float output_mult, moe_error *err) {
    cudaStream_t s = g->s;
    int Ti = (int)T, K = g->K;
    float limit = (float)g->cfg.swiglu_limit;
    bool gemv = use_gemv(g, T, act), grp = !gemv && use_grouped(g, T, act);
    if ((gemv && T * K > 65535) || (grp && max_tiles_for(T, K, g->E, MOE_CUDA_GRP_NT) > 65535) ||
        (!gemv && !grp && max_tiles_for(T, K, g->E) > 65535))
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "T = %lld tokens exceed one GPU launch's grid (split the batch)",
                        (long long)T);
    /* shared expert over all tokens: the GEMV for small T under AUTO (its
     * own rule: the routed experts' FP4 paths do not apply to it); a forced
     * path keeps one kernel for every T (batch independence) */
    bool sgemv = g->path == MOE_CUDA_PATH_GEMV || g->path == MOE_CUDA_PATH_GEMV_F32 ||
                 (g->path == MOE_CUDA_PATH_AUTO && T <= MOE_CUDA_GEMV_MAX_T);
    if (g->has_shared) {
        /* (FP4 shared experts, which no quantizer here writes, keep the
         * fp32 GEMV: the tensor-core one is tested on routed experts only) */
        if (sgemv) {
            CK(moe_k_gateup_gemv(&g->sw1, &g->sw3, w.Xb, g->Hp, NULL, 1, 1, Ti, limit, w.Hsf, g->Ips, s));
            CK(moe_k_down_gemv(&g->sw2, w.Hsf, g->Ips, act, NULL, NULL, Ti, w.Ysh, g->sw2.rows_p, s));
        } else {
            const bool t2 = wg_t256(g, g->sw1, g->sw3, g->sw2, Ti, 1);
            const int bm = t2 ? MOE_CUDA_WG_BM2 : MOE_CUDA_MMA_BM;
            int mt = (Ti + bm - 1) / bm;
            bool f = act != ACT_BF16;
            if (use_wgmma(g, g->sw1)) {
                CK(moe_k_gateup_wg(&g->sw1, &g->sw3, w.Xb, g->Hp, NULL, 1, NULL, NULL, mt, Ti, limit,
                                   f ? NULL : w.Hsb, w.Hsf, g->Ips, g->n_sm, wg_tma(g), wg_cdec(g), s, t2));
                if (f) CK(moe_k_act_round(w.Hsf, Ti, g->Ips, g->Ips, act, w.Hsb, g->Ips, s));
                CK(moe_k_down_wg(&g->sw2, w.Hsb, g->Ips, NULL, NULL, NULL, mt, Ti, w.Ysh, g->sw2.rows_p, g->n_sm,
                                 wg_tma(g), wg_cdec(g), s, t2));
            } else {
                CK(moe_k_gateup_mma(&g->sw1, &g->sw3, w.Xb, g->Hp, NULL, 1, NULL, NULL, mt, Ti, limit,
                                    f ? NULL : w.Hsb, w.Hsf, g->Ips, s));
                if (f) CK(moe_k_act_round(w.Hsf, Ti, g->Ips, g->Ips, act, w.Hsb, g->Ips, s));
                CK(moe_k_down_mma(&g->sw2, w.Hsb, g->Ips, NULL, NULL, NULL, mt, Ti, w.Ysh, g->sw2.rows_p, s));
            }
        }
    }
    combine_params cp;
    memset(&cp, 0, sizeof cp);
    cp.T = Ti;
    cp.H = g->H;
    cp.K = K;
    cp.C = C;
    cp.fused = fused;
    cp.has_shared = g->has_shared;
    cp.runner_mult = runner_mult;
    cp.output_mult = output_mult;
    cp.tw = w.tw;
    cp.Ysh = w.Ysh;
    cp.Ysh_pitch = g->has_shared ? g->sw2.rows_p : 0;
    cp.routed = w.routed;
    cp.shared = w.shared;
    cp.out = w.out;
    /* the small-T chain: the down GEMV and the combine as programmatic
     * dependents (PDL, the default), the per-assignment FP4 GEMVs' rows
     * asked of L2 MOE_CUDA_PF_STEPS K steps ahead of their register loads
     * (L2, off by default: slower, docs/performance-cuda.md, seventh
     * session); moe_cuda_layer_set_smallt_launch */
    bool pdl = (g->smallt & MOE_CUDA_SMALLT_PDL) != 0;
    int pfd = (g->smallt & MOE_CUDA_SMALLT_L2) ? MOE_CUDA_PF_STEPS : 0;
    if (gemv && gemv_tc(g, g->w1)) {
        CK(moe_k_gateup_tc(&g->w1, &g->w3, w.Xb, g->Hp, w.ids, K, C, Ti * K, limit, w.Hf, g->Ip, s, pfd));
        CK(moe_k_down_tc(&g->w2, w.Hf, g->Ip, act, w.ids, K, C, Ti * K, w.Y, g->w2.rows_p, s, pdl, pfd));
        CK(moe_k_combine(w.Y, g->w2.rows_p, &cp, s, pdl));
        return MOE_OK;
    }
    if (gemv) {
        CK(moe_k_gateup_gemv(&g->w1, &g->w3, w.Xb, g->Hp, w.ids, K, C, Ti * K, limit, w.Hf, g->Ip, s));
        CK(moe_k_down_gemv(&g->w2, w.Hf, g->Ip, act, w.ids, &cp, Ti, NULL, 0, s, pdl));
        return MOE_OK;
    }
    if (grp) {
        int mt = (int)max_tiles_for(T, K, g->E, MOE_CUDA_GRP_NT);
        CK(moe_k_sort(w.ids, Ti, K, C, g->E, MOE_CUDA_GRP_NT, w.perm, w.offsets, w.tiles, mt, w.n_tiles, w.sort_cnt,
                      s));
        CK(moe_k_gateup_grp(&g->w1, &g->w3, w.Xb, g->Hp, w.perm, C, w.tiles, w.n_tiles, mt, limit, w.Hf, g->Ip, s));
        CK(moe_k_down_grp(&g->w2, w.Hf, g->Ip, act, w.perm, w.tiles, w.n_tiles, mt, w.Y, g->w2.rows_p, s, pdl));
        CK(moe_k_combine(w.Y, g->w2.rows_p, &cp, s, pdl));
        return MOE_OK;
    }
    int np = Ti * K;
    /* bf16 operands with enough positions per expert: 256-token tiles (wg_t256) */
    const bool t2 = !use_qgmma(g, T, act) && wg_t256(g, g->w1, g->w3, g->w2, np, g->E);
    const int bm = t2 ? MOE_CUDA_WG_BM2 : MOE_CUDA_MMA_BM;
    int mt = (int)max_tiles_for(T, K, g->E, bm);
    CK(moe_k_sort(w.ids, Ti, K, C, g->E, bm, w.perm, w.offsets, w.tiles, mt, w.n_tiles, w.sort_cnt, s));
    bool f = act != ACT_BF16;
    if (use_qgmma(g, T, act)) {
        /* FP8 x FP8: the inputs' codes and scales (from Xf, as
         * moe_k_act_round rounds them), gathered into sorted order; h
         * quantized by gate/up's epilogue */
        CK(moe_k_qg_quant(w.Xf, Ti, g->H, g->Hp, act, w.Xq, w.Xqsc, g->Hp, s));
        CK(moe_k_qg_gather(w.Xq, w.Xqsc, g->Hp, w.perm, C, np, w.Xqs, w.Xqss, s));
        const bool mq = g->mxq; /* MXFP4: their E4M3 twins */
        CK(moe_k_gateup_qg(mq ? &g->q1 : &g->w1, mq ? &g->q3 : &g->w3, w.Xqs, w.Xqss, g->Hp, w.tiles, w.n_tiles, mt,
                           np, limit, act, w.Hq, w.Hqs, g->Ip, g->n_sm, s));
        CK(moe_k_down_qg(mq ? &g->q2 : &g->w2, w.Hq, w.Hqs, g->Ip, w.perm, w.tiles, w.n_tiles, mt, np, w.Y,
                         g->w2.rows_p, g->n_sm, s));
    } else if (use_wgmma(g, g->w1)) {
        if (wg_tma(g)) {
            CK(moe_k_gather_rows(w.Xb, g->Hp, w.perm, C, np, w.Xs, s));
            CK(moe_k_gateup_wg(&g->w1, &g->w3, w.Xs, g->Hp, NULL, 1, w.tiles, w.n_tiles, mt, np, limit,
                               f ? NULL : w.Hb, w.Hf, g->Ip, g->n_sm, true, wg_cdec(g), s, t2));
        } else {
            CK(moe_k_gateup_wg(&g->w1, &g->w3, w.Xb, g->Hp, w.perm, C, w.tiles, w.n_tiles, mt, np, limit,
                               f ? NULL : w.Hb, w.Hf, g->Ip, g->n_sm, false, false, s));
        }
        if (f) CK(moe_k_act_round(w.Hf, np, g->Ip, g->Ip, act, w.Hb, g->Ip, s));
        CK(moe_k_down_wg(&g->w2, w.Hb, g->Ip, w.perm, w.tiles, w.n_tiles, mt, np, w.Y, g->w2.rows_p, g->n_sm,
                         wg_tma(g), wg_cdec(g), s, t2));
    } else {
        CK(moe_k_gateup_mma(&g->w1, &g->w3, w.Xb, g->Hp, w.perm, C, w.tiles, w.n_tiles, mt, np, limit,
                            f ? NULL : w.Hb, w.Hf, g->Ip, s));
        if (f) CK(moe_k_act_round(w.Hf, np, g->Ip, g->Ip, act, w.Hb, g->Ip, s));
        CK(moe_k_down_mma(&g->w2, w.Hb, g->Ip, w.perm, w.tiles, w.n_tiles, mt, np, w.Y, g->w2.rows_p, s));
    }
    CK(moe_k_combine(w.Y, g->w2.rows_p, &cp, s));
    return MOE_OK;
}


extern "C" moe_status moe_cuda_block_run(moe_cuda_layer *g, const double *hidden, const int64_t *input_ids,
                                         int64_t T, const moe_run_opts *opts, moe_block_out *out, moe_error *err) {
    return moe_cuda_block_run_variant(g, hidden, input_ids, T, opts, NULL, out, err);
}

extern "C" moe_status moe_cuda_block_run_variant(moe_cuda_layer *g, const double *hidden, const int64_t *input_ids,
                                                 int64_t T, const moe_run_opts *opts, const moe_variant *vin,
                                                 moe_block_out *out, moe_error *err) {
    MOE_ASSERT(g && opts && out);
    const moe_variant none = moe_variant_none(), *v = vin ? vin : &none;
    if (!g->has_router) return moe_errf(err, MOE_ERR_ARG, "this GPU layer has no router (a benchmark layer)");
    int C = cols_for(g, opts);
    if (out->T != T || out->H != g->H || out->E != g->E || out->n_cols != C)
        return moe_errf(err, MOE_ERR_ARG, "output buffers were sized for another layer, T or shared mode");
    if (v->score_override > 2) return moe_errf(err, MOE_ERR_ARG, "unknown score override %d", v->score_override);
    if (T > (1 << 24)) return moe_errf(err, MOE_ERR_ARG, "T = %lld is too large for one GPU call", (long long)T);
    bool hash = g->cfg.kind == MOE_LAYER_HASH;
    moe_status st = moe_router_check_ids(&g->cfg, g->index, input_ids, T, 0, err);
    if (st != MOE_OK) return st;
    if (opts->act == MOE_ACT_NVFP4 || opts->act == MOE_ACT_NVFP4_EXPERT)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "--act %s (NVFP4 activations) has no GPU kernel yet: run it on the CPU",
                        moe_act_prec_name(opts->act));
    moe_contract c;
    /* the contract actually applied (a variant's fault included): the
     * experts stage's own function, as on the CPU */
    st = moe_contract_applied(opts->owner, opts->fuse_shared && g->has_shared, g->cfg.scaling, vin, &c, err);
    if (st != MOE_OK) return st;
    if (T == 0) return MOE_OK;
    wsl probe = layout(g, T, C, NULL);
    if ((st = ensure_ws(g, probe.total, err)) != MOE_OK) return st;
    wsl w = layout(g, T, C, (uint8_t *)g->ws);
    cudaStream_t s = g->s;
    int Ti = (int)T, E = g->E, H = g->H;

    std::vector<float> xf((size_t)T * g->Hp, 0.0f);
    for (int64_t t = 0; t < T; t++)
        for (int h = 0; h < H; h++) xf[(size_t)t * g->Hp + h] = (float)hidden[t * H + h];
    CK(cudaMemcpyAsync(w.Xf, xf.data(), xf.size() * 4, cudaMemcpyHostToDevice, s));
    if (hash) CK(cudaMemcpyAsync(w.tok, input_ids, (size_t)T * 8, cudaMemcpyHostToDevice, s));

    route_params rp;
    memset(&rp, 0, sizeof rp);
    rp.T = Ti;
    rp.E = E;
    rp.K = g->K;
    rp.C = C;
    rp.score = v->score_override >= 0 ? v->score_override : (int)g->cfg.score;
    rp.hash = hash;
    rp.n_group = g->cfg.n_group;
    rp.topk_group = g->cfg.topk_group;
    rp.group_mask_zero = v->group_mask_zero;
    rp.renormalize = g->cfg.renormalize;
    rp.not_renorm_fault = v->fault == MOE_FAULT_NOT_RENORMALIZED;
    rp.biased_weights_fault = v->fault == MOE_FAULT_BIASED_WEIGHTS;
    rp.renorm_eps = (float)v->renorm_eps;
    rp.router_mult = (float)c.router_mult;
    rp.runner_mult = (float)c.runner_mult;
    rp.output_mult = (float)c.output_mult;
    rp.fused_shared_w = (float)c.fused_shared_w;
    rp.fused = C > g->K;
    CK(moe_k_logits(w.Xf, g->gate, Ti, E, g->Hp, w.logits, s));
    CK(moe_k_route(&rp, w.logits, v->ignore_bias ? NULL : g->bias, g->tid2eid, w.tok, w.work, w.ids, w.tw, w.ew,
                   s));
    int act = act_code(opts->act);
    CK(moe_k_act_round(w.Xf, Ti, H, g->Hp, act, w.Xb, g->Hp, s));
    st = run_experts(g, w, T, C, C > g->K, act, (float)c.runner_mult, (float)c.output_mult, err);
    if (st != MOE_OK) return st;

    std::vector<float> lg((size_t)T * E), tw((size_t)T * C), ew((size_t)T * C), r((size_t)T * H), sh((size_t)T * H),
        mo((size_t)T * H);
    CK(cudaMemcpyAsync(lg.data(), w.logits, lg.size() * 4, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(out->topk_ids, w.ids, (size_t)T * C * 4, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(tw.data(), w.tw, tw.size() * 4, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(ew.data(), w.ew, ew.size() * 4, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(r.data(), w.routed, r.size() * 4, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(sh.data(), w.shared, sh.size() * 4, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(mo.data(), w.out, mo.size() * 4, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    for (size_t i = 0; i < lg.size(); i++) out->router_logits[i] = lg[i];
    for (size_t i = 0; i < tw.size(); i++) {
        out->topk_weights[i] = tw[i];
        out->eff_weights[i] = ew[i];
    }
    for (size_t i = 0; i < r.size(); i++) {
        out->routed_out[i] = r[i];
        out->shared_out[i] = sh[i];
        out->moe_out[i] = mo[i];
    }
    if (opts->check_invariants) /* float weights and combine: the f32 tolerance */
        return moe_contract_check(&g->cfg, g->index, out, true, vin, err);
    return MOE_OK;
}

/* ------------------------------------------- self-test: no room for twins */

/* A V4-Flash-sized MXFP4 layer (256 experts of 2048 x 4096, top 6,
 * moe_cuda_layer_random) uploaded into a device filled up to leave its FP4
 * bytes plus 1 GiB: the 6 GiB of E4M3 twins cannot be allocated, and the
 * upload must still succeed, say so in its note, and run FP8 activations
 * (T = 64, the bf16-operand kernels). Skipped (0, with a line saying why)
 * where the device has not the FP4 bytes plus 2 GiB free. */
extern "C" int moe_cuda_mxq_room_selftest(char *msg, size_t n) {
    size_t used = 0;
    if (msg && n) msg[0] = 0;
    const int H = 4096, I = 2048, E = 256, K = 6;
    const size_t fp4 = (size_t)E * 3 * ((size_t)H * I / 2 + (size_t)H * I / 32), gib = (size_t)1 << 30;
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) != cudaSuccess || fr < fp4 + 2 * gib) {
        moe_st_put(msg, n, &used, "no room for twins: skipped (%.1f GiB free, %.1f needed)\n", (double)fr / gib,
                   (double)(fp4 + 2 * gib) / gib);
        return 0;
    }
    void *fill = nullptr;
    size_t fb = fr - fp4 - gib;
    while (cudaMalloc(&fill, fb) != cudaSuccess && fb > gib) { /* what is free may be less than reported */
        (void)cudaGetLastError();
        fb -= gib / 4;
    }
    moe_cuda_layer *g = nullptr;
    moe_error err;
    memset(&err, 0, sizeof err);
    moe_status st = fill ? moe_cuda_layer_random(MOE_WFMT_MXFP4, H, I, E, K, 7, &g, &err)
                         : moe_errf(&err, MOE_ERR_NOMEM, "could not fill the device (%.1f GiB free)", (double)fr / gib);
    int fails = 0;
    const char *note = g ? moe_cuda_layer_note(g) : nullptr;
    if (st != MOE_OK) {
        moe_st_put(msg, n, &used, "no room for twins: the upload failed: %s\n", err.msg);
        fails++;
    } else if (!note || !strstr(note, "do not fit")) {
        moe_st_put(msg, n, &used, "no room for twins: the note does not say so: %s\n", note ? note : "(none)");
        fails++;
    } else {
        const char *ops = moe_cuda_layer_operands(g, 64, MOE_ACT_FP8);
        std::vector<int32_t> ids((size_t)64 * K);
        std::vector<float> w((size_t)64 * K, 1.0f / K);
        for (int t = 0; t < 64; t++)
            for (int k = 0; k < K; k++) ids[(size_t)t * K + k] = (t * 37 + k * 41) % E;
        double ms = 0;
        st = moe_cuda_bench_experts(g, 64, MOE_ACT_FP8, ids.data(), w.data(), 1, 1, 1, false, &ms, &err);
        moe_st_put(msg, n, &used, "no room for twins: %s; operands at T = 64 %s; a T = 64 FP8 run: %s (%.3f ms)\n",
                   note, ops, st == MOE_OK ? "ok" : err.msg, ms);
        fails += st != MOE_OK || strcmp(ops, "bf16") != 0;
    }
    moe_cuda_layer_free(g);
    if (fill) cudaFree(fill);
    return fails;
}

/* ---------------------------------------------------------- benchmark */

extern "C" moe_status moe_cuda_bench_experts(moe_cuda_layer *g, int64_t T, moe_act_prec actp, const int32_t *ids,
                                             const float *weights, int n_sets, int warmup, int iters, bool graphs,
                                             double *times_ms, moe_error *err) {
    if (T < 1 || n_sets < 1 || iters < 1 || warmup < 0) return moe_errf(err, MOE_ERR_ARG, "bad bench arguments");
    int K = g->K, C = K, Ti = (int)T;
    for (size_t i = 0; i < (size_t)n_sets * T * K; i++)
        if (ids[i] < 0 || ids[i] >= g->E) return moe_errf(err, MOE_ERR_ARG, "bench expert id %d out of range", ids[i]);
    bool had_shared = g->has_shared;
    g->has_shared = false; /* routed experts only */
    wsl probe = layout(g, T, C, NULL);
    moe_status st = ensure_ws(g, probe.total, err);
    if (st != MOE_OK) { g->has_shared = had_shared; return st; }
    wsl w = layout(g, T, C, (uint8_t *)g->ws);
    cudaStream_t s = g->s;
    int32_t *dids = NULL;
    float *dtw = NULL;
    std::vector<cudaEvent_t> ev(2 * (size_t)(warmup + iters), nullptr);
    if (actp == MOE_ACT_NVFP4 || actp == MOE_ACT_NVFP4_EXPERT)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "NVFP4 activations have no GPU kernel yet");
    int act = act_code(actp);
    size_t nid = (size_t)n_sets * T * K;
    st = MOE_OK;
    cudaError_t ce = cudaMalloc(&dids, nid * 4);
    if (ce == cudaSuccess) ce = cudaMalloc(&dtw, nid * 4);
    if (ce == cudaSuccess) ce = cudaMemcpy(dids, ids, nid * 4, cudaMemcpyHostToDevice);
    if (ce == cudaSuccess) ce = cudaMemcpy(dtw, weights, nid * 4, cudaMemcpyHostToDevice);
    /* random activations in +-[0.5, 1) * 2^k, k small: bf16 codes as floats */
    if (ce == cudaSuccess) ce = moe_k_fill_random((uint8_t *)w.Xb, (size_t)T * g->Hp * 2, 99, 2, s);
    for (size_t i = 0; ce == cudaSuccess && i < ev.size(); i++) ce = cudaEventCreate(&ev[i]);
    if (ce == cudaSuccess && act != ACT_BF16) {
        /* FP8 activations: round the bf16 inputs through E4M3 per 128 */
        std::vector<uint16_t> xb((size_t)T * g->Hp);
        ce = cudaMemcpyAsync(xb.data(), w.Xb, xb.size() * 2, cudaMemcpyDeviceToHost, s);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
        std::vector<float> xf(xb.size());
        for (size_t i = 0; i < xb.size(); i++) {
            uint32_t u = (uint32_t)xb[i] << 16;
            memcpy(&xf[i], &u, 4);
        }
        if (ce == cudaSuccess) ce = cudaMemcpyAsync(w.Xf, xf.data(), xf.size() * 4, cudaMemcpyHostToDevice, s);
        if (ce == cudaSuccess) ce = moe_k_act_round(w.Xf, Ti, g->H, g->Hp, act, w.Xb, g->Hp, s);
        if (ce == cudaSuccess) ce = cudaStreamSynchronize(s);
    }
    if (ce != cudaSuccess) st = moe_errf(err, MOE_ERR_IO, "CUDA error preparing the bench: %s", cudaGetErrorString(ce));
    /* one CUDA graph per routing set (captured after a plain warm-up run,
     * which also sets the kernels' shared-memory limits) */
    std::vector<cudaGraphExec_t> ge(graphs ? (size_t)n_sets : 0, nullptr);
    for (int set = 0; st == MOE_OK && graphs && set < n_sets; set++) {
        wsl wi = w;
        wi.ids = dids + (size_t)set * T * K;
        wi.tw = dtw + (size_t)set * T * K;
        st = run_experts(g, wi, T, C, false, act, 1.0f, 1.0f, err);
        if (st != MOE_OK) break;
        cudaGraph_t gr = nullptr;
        ce = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
        if (ce != cudaSuccess) { st = moe_errf(err, MOE_ERR_IO, "CUDA graph capture: %s", cudaGetErrorString(ce)); break; }
        moe_status cst = run_experts(g, wi, T, C, false, act, 1.0f, 1.0f, err);
        ce = cudaStreamEndCapture(s, &gr);
        if (cst != MOE_OK) { st = cst; if (gr) cudaGraphDestroy(gr); break; }
        if (ce == cudaSuccess) ce = cudaGraphInstantiate(&ge[set], gr, 0);
        if (gr) cudaGraphDestroy(gr);
        if (ce != cudaSuccess) st = moe_errf(err, MOE_ERR_IO, "CUDA graph capture: %s", cudaGetErrorString(ce));
    }
    for (int it = 0; st == MOE_OK && it < warmup + iters; it++) {
        int set = it % n_sets;
        wsl wi = w;
        wi.ids = dids + (size_t)set * T * K;
        wi.tw = dtw + (size_t)set * T * K;
        ce = cudaEventRecord(ev[2 * it], s);
        if (ce != cudaSuccess) { st = moe_errf(err, MOE_ERR_IO, "CUDA error: %s", cudaGetErrorString(ce)); break; }
        if (graphs) {
            ce = cudaGraphLaunch(ge[set], s);
            if (ce != cudaSuccess) { st = moe_errf(err, MOE_ERR_IO, "CUDA graph launch: %s", cudaGetErrorString(ce)); break; }
        } else {
            st = run_experts(g, wi, T, C, false, act, 1.0f, 1.0f, err);
            if (st != MOE_OK) break;
        }
        ce = cudaEventRecord(ev[2 * it + 1], s);
        if (ce != cudaSuccess) st = moe_errf(err, MOE_ERR_IO, "CUDA error: %s", cudaGetErrorString(ce));
    }
    if (st == MOE_OK) {
        ce = cudaStreamSynchronize(s);
        if (ce != cudaSuccess) st = moe_errf(err, MOE_ERR_IO, "CUDA error in the bench run: %s", cudaGetErrorString(ce));
    }
    for (int it = 0; st == MOE_OK && it < iters; it++) {
        float ms = 0;
        ce = cudaEventElapsedTime(&ms, ev[2 * (warmup + it)], ev[2 * (warmup + it) + 1]);
        if (ce != cudaSuccess) st = moe_errf(err, MOE_ERR_IO, "CUDA error: %s", cudaGetErrorString(ce));
        times_ms[it] = ms;
    }
    cudaStreamSynchronize(s);
    for (cudaGraphExec_t x : ge)
        if (x) cudaGraphExecDestroy(x);
    for (cudaEvent_t e : ev)
        if (e) cudaEventDestroy(e);
    cudaFree(dids);
    cudaFree(dtw);
    g->has_shared = had_shared;
    return st;
}

extern "C" moe_status moe_cuda_measure_ceilings(double *copy_bps, double *bf16_fps, moe_error *err) {
    *copy_bps = 0;
    *bf16_fps = 0;
    if (moe_cuda_device_count() == 0) return moe_errf(err, MOE_ERR_UNSUPPORTED, "no CUDA device is present");
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    size_t bytes = (size_t)1 << 31;
    void *a = NULL, *b = NULL;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(moe_k_fill_random((uint8_t *)a, bytes, 1, 0, s));
    float best = 1e30f;
    for (int r = 0; r < 12; r++) {
        CK(cudaEventRecord(e0, s));
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 2 && ms < best) best = ms;
    }
    *copy_bps = 2.0 * (double)bytes / (best * 1e-3);
    CK(cudaFree(a));
    CK(cudaFree(b));
#ifdef MOE_HAVE_CUBLAS
    moe_error lerr;
    if (cublas_load(&lerr)) {
        int n = 8192;
        size_t mb = (size_t)n * n * 2;
        void *A = NULL, *B = NULL, *Cm = NULL;
        CK(cudaMalloc(&A, mb));
        CK(cudaMalloc(&B, mb));
        CK(cudaMalloc(&Cm, mb));
        CK(moe_k_fill_random((uint8_t *)A, mb, 2, 2, s));
        CK(moe_k_fill_random((uint8_t *)B, mb, 3, 2, s));
        cublasHandle_t h;
        if (g_cublas.create(&h) != CUBLAS_STATUS_SUCCESS) return moe_errf(err, MOE_ERR_IO, "cublasCreate failed");
        g_cublas.set_stream(h, s);
        float alpha = 1.0f, beta = 0.0f;
        float bestg = 1e30f;
        for (int r = 0; r < 13; r++) {
            CK(cudaEventRecord(e0, s));
            cublasStatus_t cs = g_cublas.gemm_ex(h, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, A, CUDA_R_16BF, n, B,
                                             CUDA_R_16BF, n, &beta, Cm, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                             CUBLAS_GEMM_DEFAULT);
            if (cs != CUBLAS_STATUS_SUCCESS) {
                g_cublas.destroy(h);
                return moe_errf(err, MOE_ERR_IO, "cublasGemmEx failed (%d)", (int)cs);
            }
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            if (r >= 3 && ms < bestg) bestg = ms;
        }
        g_cublas.destroy(h);
        *bf16_fps = 2.0 * (double)n * n * n / (bestg * 1e-3);
        CK(cudaFree(A));
        CK(cudaFree(B));
        CK(cudaFree(Cm));
    }
#endif
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaStreamDestroy(s));
    return MOE_OK;
}

extern "C" moe_status moe_cuda_measure_fp8_peak(double *fp8_fps, moe_error *err) {
    *fp8_fps = 0;
    if (moe_cuda_device_count() == 0) return moe_errf(err, MOE_ERR_UNSUPPORTED, "no CUDA device is present");
#ifdef MOE_HAVE_CUBLASLT
    if (!cublaslt_load(err)) return MOE_OK; /* no cuBLASLt: a 0 rate, as for a refused algorithm */
    const int n = 8192;
    const size_t ab = (size_t)n * n, cb = (size_t)n * n * 2, wsb = (size_t)64 << 20;
    void *A = NULL, *B = NULL, *Cm = NULL, *ws = NULL;
    cudaStream_t s;
    cudaEvent_t e0, e1;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaMalloc(&A, ab));
    CK(cudaMalloc(&B, ab));
    CK(cudaMalloc(&Cm, cb));
    CK(cudaMalloc(&ws, wsb));
    CK(moe_k_fill_random((uint8_t *)A, ab, 4, 1, s)); /* finite E4M3 codes */
    CK(moe_k_fill_random((uint8_t *)B, ab, 5, 1, s));
    cublasLtHandle_t lt = NULL;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int nres = 0;
    float alpha = 1.0f, beta = 0.0f, best = 1e30f;
    const cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N; /* FP8 takes A transposed (TN) */
    bool ok = g_lt.create(&lt) == CUBLAS_STATUS_SUCCESS &&
              g_lt.desc_create(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
              g_lt.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA) == CUBLAS_STATUS_SUCCESS &&
              g_lt.desc_set(op, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB) == CUBLAS_STATUS_SUCCESS &&
              g_lt.layout_create(&la, CUDA_R_8F_E4M3, n, n, n) == CUBLAS_STATUS_SUCCESS &&
              g_lt.layout_create(&lb, CUDA_R_8F_E4M3, n, n, n) == CUBLAS_STATUS_SUCCESS &&
              g_lt.layout_create(&lc, CUDA_R_16BF, n, n, n) == CUBLAS_STATUS_SUCCESS &&
              g_lt.pref_create(&pref) == CUBLAS_STATUS_SUCCESS &&
              g_lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb) ==
                  CUBLAS_STATUS_SUCCESS &&
              g_lt.heuristic(lt, op, la, lb, lc, lc, pref, 1, &res, &nres) == CUBLAS_STATUS_SUCCESS &&
              nres > 0;
    for (int r = 0; ok && r < 13; r++) {
        ok = cudaEventRecord(e0, s) == cudaSuccess &&
             g_lt.matmul(lt, op, &alpha, A, la, B, lb, &beta, Cm, lc, Cm, lc, &res.algo, ws, wsb, s) ==
                 CUBLAS_STATUS_SUCCESS &&
             cudaEventRecord(e1, s) == cudaSuccess && cudaEventSynchronize(e1) == cudaSuccess;
        float ms = 0;
        if (ok && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && r >= 3 && ms < best) best = ms;
    }
    if (ok && best < 1e30f) *fp8_fps = 2.0 * (double)n * n * n / (best * 1e-3);
    if (pref) g_lt.pref_destroy(pref);
    if (la) g_lt.layout_destroy(la);
    if (lb) g_lt.layout_destroy(lb);
    if (lc) g_lt.layout_destroy(lc);
    if (op) g_lt.desc_destroy(op);
    if (lt) g_lt.destroy(lt);
    (void)cudaGetLastError(); /* a refused algorithm is a 0 rate, not an error */
    CK(cudaStreamSynchronize(s));
    CK(cudaFree(A));
    CK(cudaFree(B));
    CK(cudaFree(Cm));
    CK(cudaFree(ws));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    CK(cudaStreamDestroy(s));
#endif
    return MOE_OK;
}
