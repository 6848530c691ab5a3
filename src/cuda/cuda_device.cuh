/*
 * Device helpers shared by the GPU kernels (cuda_kernels.cu, cuda_gemv_tc.cu):
 * exact FP4 / FP8 decoders, the activation rounding of one 128-value block,
 * weight row addressing, cache-hinted loads and the clamped SwiGLU.
 */
#ifndef MOE_CUDA_DEVICE_CUH
#define MOE_CUDA_DEVICE_CUH

#include "cuda/cuda_internal.cuh"

#include <math.h>

/* Eight E2M1 nibbles of w (element k at bits 4k..4k+3) as E4M3 bytes of
 * value e2m1 x 2^-6, exactly: the 3-bit magnitude code placed at bits 2..4
 * of a byte is the E4M3 subnormal (E = 0) or normal encoding of the value
 * times 2^-6, the sign goes to bit 7. ev: elements 0, 2, 4, 6; od: 1, 3, 5, 7. */
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t w, uint32_t &ev, uint32_t &od) {
    ev = ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
    od = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

__device__ __forceinline__ float2 fp8x2_to_f2(uint16_t v) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)v, __NV_E4M3);
    return __half22float2(*reinterpret_cast<__half2 *>(&h));
}

/* smallest e with 448 * 2^e >= a (a > 0 finite), exactly */
__device__ __forceinline__ int fp8_pow2_exp(float a) {
    int e = ilogbf(a) - 8;
    while (ldexpf(448.0f, e) < a) e++;
    while (ldexpf(448.0f, e - 1) >= a) e--;
    return e;
}

/* The E4M3 code of x in an FP8 activation block of scale sc: x / sc,
 * saturated, to nearest. POW2 (ACT_FP8_POW2, sc a power of two; inv =
 * 1 / sc): x * inv, which is exact, so the product rounds the same real
 * number as the quotient and the code is the same, without div.rn.f32's
 * subroutine for a subnormal quotient (tiny values such as h after SwiGLU:
 * the lanes that take it serialize the warp). ACT_FP8_F32: the IEEE
 * quotient (inv unused). */
template <bool POW2> __device__ __forceinline__ uint32_t fp8_code(float x, float sc, float inv) {
    return (uint32_t)__nv_cvt_float_to_fp8(POW2 ? x * inv : x / sc, __NV_SATFINITE, __NV_E4M3);
}

/* The FP8 activation rounding of one value given its block scale: its
 * fp8_code, decoded, times sc. */
template <bool POW2> __device__ __forceinline__ float fp8_round(float x, float sc, float inv) {
    __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)fp8_code<POW2>(x, sc, inv), __NV_E4M3);
    return __half2float(*reinterpret_cast<__half *>(&h)) * sc;
}

/* Block scale of an FP8 activation block from its amax (bad: NaN/Inf seen). */
__device__ __forceinline__ float fp8_block_scale(float amax, bool bad, int act) {
    if (bad) return __int_as_float(0x7FC00000);
    amax = fmaxf(amax, 1e-4f);
    if (act == ACT_FP8_F32) return amax / 448.0f;
    return ldexpf(1.0f, fp8_pow2_exp(amax));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* One warp over the 128-value activation block starting at c0 of row src:
 * lane holds columns c0 + 4 lane .. + 3 (0 past n), rounded as `act` says
 * (FP8: E4M3 with the block's shared scale from the warp's amax; bf16 is
 * left to the caller's conversion). Shared by the rounding kernel and the
 * GEMVs' activation staging. */
__device__ __forceinline__ void warp_act128(const float *__restrict__ src, int c0, int n, int act, int lane,
                                            float v[4]) {
    float amax = 0.0f;
    bool bad = false;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int c = c0 + lane * 4 + i;
        v[i] = c < n ? src[c] : 0.0f;
        float a = fabsf(v[i]);
        if (!(a <= 3.402823466e38f)) bad = true;
        else amax = fmaxf(amax, a);
    }
    if (act != ACT_BF16) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        bad = __any_sync(0xffffffffu, bad);
        const float sc = fp8_block_scale(amax, bad, act), inv = 1.0f / sc;
        if (act == ACT_FP8_F32) {
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] = fp8_round<false>(v[i], sc, inv);
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) v[i] = fp8_round<true>(v[i], sc, inv);
        }
    }
}

template <int F> __device__ __forceinline__ size_t row_bytes(int kp) {
    return F == DF_BF16 ? (size_t)kp * 2 : F == DF_FP8 ? (size_t)kp : (size_t)kp / 2;
}

/* Scale row of row r of expert e. */
template <int F> __device__ __forceinline__ const uint8_t *scale_row(const dweights &w, int e, int r) {
    const uint8_t *base = w.scale + (size_t)e * w.sstride;
    if (F == DF_FP8) return base + (size_t)(r / 128) * ((w.kp + 127) / 128) * 4;
    if (F == DF_MXFP4) return base + (size_t)r * (w.kp / 32);
    if (F == DF_NVFP4) return base + (size_t)r * (w.kp / 16);
    return nullptr;
}

__device__ __forceinline__ uint4 ldg16(const uint8_t *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* Ask L2 for the line holding p (no register, no wait): issued before a
 * block stages its activations, so the weight loads after the barrier hit L2
 * instead of waiting a full HBM round trip behind the staging's own. */
__device__ __forceinline__ void prefetch_l2(const uint8_t *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

/* Programmatic dependent launch (sm_90; cuda_layer.cu's small-T chain).
 * griddep_launch: this block lets the next kernel, when that one was
 * launched with the programmatic-serialization attribute, start before this
 * grid ends (its blocks run up to their griddep_wait). griddep_wait: block
 * until the preceding grid has completed and its writes are visible; a
 * no-op when this kernel was launched without the attribute. A kernel
 * launched with it must call griddep_wait in every block, on every path,
 * before it reads the preceding kernel's output or exits: then its own
 * completion still implies its predecessor's, for the kernel after it. */
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* silu(g) * u with the clamp: the one definition every GPU kernel's
 * gate/up epilogue calls (the GPU paths agree with each other bit for bit).
 * The quotient is PTX div.full.f32 (within 2 ulp over the whole range, one
 * fixed instruction sequence), not the IEEE `/`: div.rn.f32 leaves its fast
 * path for a divisor past 2^126 or infinite, which 1 + e^-g is for every
 * g < -87.3, and the lanes that take that subroutine serialize the warp.
 * Gate pre-activations that negative are ordinary in MoE layers (the bench's
 * MXFP4 experts have 7% of them), and with `/` they made the FP8 GEMMs'
 * gate/up epilogue the slowest part of the kernel (docs/performance-cuda.md,
 * ninth session). 2 ulp of fp32 is far inside every GPU test tolerance
 * (tests/cuda/test-cuda.c: 2e-4 and up, relative). */
__device__ __forceinline__ float swiglu(float g, float u, float L) {
    if (L > 0.0f) {
        g = g > L ? L : g;
        u = u > L ? L : (u < -L ? -L : u);
    }
    float s;
    asm("div.full.f32 %0, %1, %2;" : "=f"(s) : "f"(g), "f"(1.0f + expf(-g)));
    return s * u;
}

#endif
