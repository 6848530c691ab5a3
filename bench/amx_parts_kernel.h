/*
 * One build of the AMX kernel (src/cpu/amx/gemm_amx.c) for bench/amx_parts:
 * the file's own source under another table name (MOE_AMX_TABLE_NAME), with
 * the compile-time variants its header lists set by the including file, plus
 * entry points to its parts (packing alone, decode alone) so that they are
 * timed as the kernel runs them. The including file defines AMX_PARTS_V(x)
 * (the variant's suffix) and the MOE_AMX_* knobs, and may define
 * AMX_PARTS_NO_DECODE: the decode's arithmetic replaced by zeros (its loop,
 * loads of the scales, stores and prefetches stay), to time the rest.
 * Built only with AMX compiler support (CMakeLists.txt).
 */
#ifndef AMX_PARTS_V
#error "define AMX_PARTS_V(name) before including amx_parts_kernel.h"
#endif

#include "cpu/avx512/e2m1_bf16.h"
#include "amx_parts.h"

#ifdef AMX_PARTS_NO_DECODE
#define bf_decode_chunk(fmt, rw, r, tab, c, sh) ((void)(rw), (void)(tab), (void)(c), (void)(sh), _mm512_setzero_si512())
#endif

#define MOE_AMX_TABLE_NAME AMX_PARTS_V(amx_parts_table)
#include "cpu/amx/gemm_amx.c"

/* bench/amx_parts.h: amx_parts_pack */
void AMX_PARTS_V(amx_parts_pack)(const float *X, int64_t ldx, int64_t n, int64_t cols, void *ws) {
    amx_layout l = amx_layout_of(cols, n);
    amx_pack(&l, X, ldx, n, cols, true, (uint32_t *)((char *)ws + l.b_off));
}

/* bench/amx_parts.h: amx_parts_decode (MXFP4: the kernel's row blocks of
 * 32 and K blocks of AMX_KB steps, into one panel) */
void AMX_PARTS_V(amx_parts_decode)(const moe_weight *w, int64_t r0, int64_t r1, void *ws) {
    amx_layout l = amx_layout_of(w->cols, 32);
    uint16_t *panel = (uint16_t *)((char *)ws + l.p_off);
    const uint16_t *tab = moe_cpu_e2m1_bf16_tab(false);
    for (int64_t j0 = r0; j0 < r1; j0 += AMX_ROWS) {
        int64_t nr = r1 - j0 < AMX_ROWS ? r1 - j0 : AMX_ROWS;
        for (int64_t k0 = 0; k0 < l.steps; k0 += AMX_KB)
            amx_decode(MOE_WFMT_MXFP4, w, j0, nr, nr > 16 ? 2 : 1, k0, l.steps - k0 < AMX_KB ? l.steps - k0 : AMX_KB,
                       AMX_KB, tab, panel);
        AMX_MEMORY_BARRIER();
    }
}
