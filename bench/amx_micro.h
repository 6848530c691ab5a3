/*
 * The TDPBF16PS micro-kernel of the bench's AMX peak (bench/bench.c) and of
 * moe-amx-parts' per-thread peaks (bench/amx_parts.c): one definition, so
 * both tools measure the same loop.
 *
 * C[32, 32] += A[32, K] . B[K, 32] in bf16 with the kernel's blocking
 * (src/cpu/amx/gemm_amx.c): 4 C tiles (16 x 16 fp32), per 32-column step 2 A
 * tiles and 2 B tiles loaded from L1 (A and B hold `steps` x 2 KiB, cycled)
 * and 4 TDPBF16PS. Returns flops done. The tiles are configured here and
 * released before returning; the caller has the OS's permission for the
 * tile data (the CPU detection asks for it: moe_cpu_table).
 */
#ifndef MOE_BENCH_AMX_MICRO_H
#define MOE_BENCH_AMX_MICRO_H

#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

typedef struct bench_amx_cfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} bench_amx_cfg;

/* All 8 tiles configured 16 x 64 bytes, the C tiles 0-3 zeroed. */
__attribute__((target("amx-tile"), always_inline)) static inline void bench_amx_begin(void) {
    bench_amx_cfg cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    __asm__ volatile("" ::: "memory"); /* gcc's tile intrinsics do not declare their memory reads */
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* The C tiles 0-3 out to C (4 x 256 floats), the tiles released. */
__attribute__((target("amx-tile"), always_inline)) static inline void bench_amx_end(float *C) {
    _tile_stored(0, C, 64);
    _tile_stored(1, C + 256, 64);
    _tile_stored(2, C + 512, 64);
    _tile_stored(3, C + 768, 64);
    _tile_release();
}

/* One 2 x 2 step: A tiles 4, 5 from a and B tiles 6, 7 from b (each pair
 * 1 KiB apart; B by TILELOADDT1 when stream), 4 TDPBF16PS into C 0-3. */
__attribute__((target("amx-tile,amx-bf16"), always_inline)) static inline void
bench_amx_step22(const uint16_t *a, const uint16_t *b, bool stream) {
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + 512, 64);
    if (stream) {
        _tile_stream_loadd(6, b, 64);
        _tile_stream_loadd(7, b + 512, 64);
    } else {
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 512, 64);
    }
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
}

__attribute__((target("amx-tile,amx-bf16"))) static inline double bench_micro_amx(const uint16_t *A,
                                                                                  const uint16_t *B, float *C,
                                                                                  int steps, int reps) {
    bench_amx_begin();
    for (int r = 0; r < reps; r++)
        for (int s = 0; s < steps; s++) {
            bench_amx_step22(A + (size_t)s * 2 * 512, B + (size_t)s * 2 * 512, false);
        }
    bench_amx_end(C);
    return 2.0 * 32 * 32 * 32 * (double)steps * (double)reps;
}

#endif
