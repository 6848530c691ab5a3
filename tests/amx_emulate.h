/*
 * A software AMX for tests: the tile intrinsics src/cpu/amx/gemm_amx.c uses
 * (_tile_loadconfig, _tile_release, _tile_zero, _tile_loadd, _tile_stored,
 * _tile_dpbf16ps) as C functions on thread-local tile registers, with
 * TDPBF16PS written from Intel's SDM text (per row: even and odd products in
 * two fp32 chains from zero, DAZ/FTZ/RNE; their sum added to the
 * destination). test-amx-emu compiles the kernel's own source against it, so
 * the kernel's packing, panels, blocking and staging run, and are checked
 * bit for bit, on a CPU without AMX. It checks the tile shapes the kernel
 * configures against each instruction (as the hardware would fault) and
 * counts instructions. It is not the hardware: the real kernel is checked
 * against the same model on an AMX CPU (test-kernels).
 *
 * Include after <immintrin.h>: it replaces gcc's tile macros.
 */
#ifndef MOE_TEST_AMX_EMULATE_H
#define MOE_TEST_AMX_EMULATE_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_dpbf16ps

typedef struct amx_emu_state {
    int configured;
    uint16_t colsb[8];
    uint8_t rows[8];
    uint8_t t[8][16][64];
} amx_emu_state;

static _Thread_local amx_emu_state amx_emu;
static long amx_emu_fault, amx_emu_dp; /* shape violations; TDPBF16PS executed */

static inline void amx_emu_check(int ok) {
    if (!ok) {
#ifdef _OPENMP
#pragma omp atomic
#endif
        amx_emu_fault++;
    }
}

static inline void amx_emu_loadconfig(const void *cfg) {
    const uint8_t *c = cfg;
    amx_emu_check(c[0] == 1);
    memset(&amx_emu, 0, sizeof amx_emu);
    for (int i = 0; i < 8; i++) {
        memcpy(&amx_emu.colsb[i], c + 16 + 2 * i, 2);
        amx_emu.rows[i] = c[48 + i];
        amx_emu_check(amx_emu.colsb[i] <= 64 && amx_emu.rows[i] <= 16);
    }
    amx_emu.configured = 1;
}

static inline void amx_emu_release(void) { memset(&amx_emu, 0, sizeof amx_emu); }

static inline void amx_emu_zero(int t) {
    amx_emu_check(amx_emu.configured);
    memset(amx_emu.t[t], 0, sizeof amx_emu.t[t]);
}

static inline void amx_emu_loadd(int t, const void *base, long stride) {
    amx_emu_check(amx_emu.configured);
    memset(amx_emu.t[t], 0, sizeof amx_emu.t[t]);
    for (int r = 0; r < amx_emu.rows[t]; r++) memcpy(amx_emu.t[t][r], (const char *)base + r * stride, amx_emu.colsb[t]);
}

static inline void amx_emu_stored(int t, void *base, long stride) {
    amx_emu_check(amx_emu.configured);
    for (int r = 0; r < amx_emu.rows[t]; r++) memcpy((char *)base + r * stride, amx_emu.t[t][r], amx_emu.colsb[t]);
}

static inline float amx_emu_daz(float v) { return fabsf(v) < 0x1p-126f ? copysignf(0.0f, v) : v; }
static inline float amx_emu_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return amx_emu_daz(f);
}

static inline void amx_emu_dpbf16ps(int dst, int a, int b) {
    amx_emu_check(amx_emu.configured);
    int M = amx_emu.rows[dst], N = amx_emu.colsb[dst] / 4, K = amx_emu.colsb[a] / 4;
    amx_emu_check(amx_emu.rows[a] == M && amx_emu.rows[b] == K && amx_emu.colsb[b] == amx_emu.colsb[dst]);
#ifdef _OPENMP
#pragma omp atomic
#endif
    amx_emu_dp++;
    for (int m = 0; m < M; m++) {
        float temp[32] = {0};
        for (int k = 0; k < K; k++)
            for (int n = 0; n < N; n++)
                for (int h = 0; h < 2; h++) {
                    float x = amx_emu_bf16(amx_emu.t[a][m] + 4 * k + 2 * h);
                    float y = amx_emu_bf16(amx_emu.t[b][k] + 4 * n + 2 * h);
                    temp[2 * n + h] = amx_emu_daz(fmaf(x, y, amx_emu_daz(temp[2 * n + h])));
                }
        for (int n = 0; n < N; n++) {
            float c;
            memcpy(&c, amx_emu.t[dst][m] + 4 * n, 4);
            float s = amx_emu_daz(amx_emu_daz(temp[2 * n]) + amx_emu_daz(temp[2 * n + 1]));
            c = amx_emu_daz(amx_emu_daz(c) + s);
            memcpy(amx_emu.t[dst][m] + 4 * n, &c, 4);
        }
    }
}

/* Shape violations so far (for the test's final check). */
/* Each build of the kernel against these tiles names its own count
 * (tests/amx_emu_kernel*.c) */
#ifndef AMX_EMU_FAULT_COUNT
#define AMX_EMU_FAULT_COUNT amx_emu_fault_count
#endif
long AMX_EMU_FAULT_COUNT(void);
long AMX_EMU_FAULT_COUNT(void) { return amx_emu_fault; }

#define _tile_loadconfig(cfg) amx_emu_loadconfig(cfg)
#define _tile_release() amx_emu_release()
#define _tile_zero(t) amx_emu_zero(t)
#define _tile_loadd(t, base, stride) amx_emu_loadd(t, base, (long)(stride))
#define _tile_stream_loadd(t, base, stride) amx_emu_loadd(t, base, (long)(stride)) /* TILELOADDT1: a hint only */
#define _tile_stored(t, base, stride) amx_emu_stored(t, base, (long)(stride))
#define _tile_dpbf16ps(d, a, b) amx_emu_dpbf16ps(d, a, b)

#endif
