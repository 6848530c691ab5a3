/*
 * The kernel tables by ISA: BLIS-style per-call dispatch. A run names its
 * ISA (moe_run_opts.isa); moe_cpu_table resolves it to an immutable table
 * for that call. There is no active table and no global choice.
 *
 * Invariants:
 *  1. Every table starts as the reference table and is overridden entry by
 *     entry, so an entry an ISA lacks is the reference one. gemm_bf16act is
 *     set on the avx512 table of a CPU with AVX512_BF16 (cpuid leaf 7
 *     subleaf 1, EAX bit 5) and on the amx table; elsewhere it is NULL.
 *  2. Resolution reads only the CPU's features (src/core/cpuid.c, detected
 *     once) and its argument: the same ISA gives the same table on every
 *     call and thread. The environment is never read here (MOE_ISA is the
 *     CLI's default).
 *  3. MOE_ISA_AUTO is avx512 when present, else avx2, else ref. amx comes
 *     only by name: the amx and avx512 tables run the same f32 kernels;
 *     with bf16 activations the AMX tiles measured 3.6-4.8x faster than
 *     vdpbf16ps at T >= 1024 tokens per block but 2.4-3x slower at T <= 128
 *     on a 16-core Xeon (docs/performance.md), and a table may not switch
 *     on T (kernels.h, contract 2): the tiles are the choice of those who
 *     run large batches (--isa amx, MOE_ISA=amx).
 */
#include "cpu/cpu_internal.h"

#include <string.h>

static const char *const isa_names[] = {"auto", "ref", "avx2", "avx512", "amx"};

const char *moe_isa_name(moe_isa isa) { return (unsigned)isa <= MOE_ISA_AMX ? isa_names[isa] : "?"; }

moe_status moe_isa_parse(const char *s, moe_isa *isa, moe_error *err) {
    MOE_ASSERT(isa);
    for (int i = 0; s && i <= (int)MOE_ISA_AMX; i++)
        if (strcmp(s, isa_names[i]) == 0) { *isa = (moe_isa)i; return MOE_OK; }
    return moe_errf(err, MOE_ERR_ARG, "unknown ISA \"%s\" (auto, ref, avx2, avx512, amx)", s ? s : "(null)");
}

static bool have_avx512(const moe_cpu_features *f) {
    return f->os_avx512 && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->avx512vbmi &&
           f->fma && f->f16c;
}

static bool have_avx2(const moe_cpu_features *f) { return f->os_avx && f->avx2 && f->fma && f->f16c; }

static bool have_amx(const moe_cpu_features *f) {
    return have_avx512(f) && f->avx512bf16 && f->amx_tile && f->amx_bf16 && moe_cpu_amx_table() != NULL;
}

static bool available(moe_isa isa, const moe_cpu_features *f) {
    switch (isa) {
    case MOE_ISA_AUTO:
    case MOE_ISA_REF: return true;
    case MOE_ISA_AVX2: return have_avx2(f);
    case MOE_ISA_AVX512: return have_avx512(f);
    case MOE_ISA_AMX: return have_amx(f);
    }
    return false;
}

moe_status moe_isa_resolve(moe_isa isa, moe_isa *out, moe_error *err) {
    MOE_ASSERT(out);
    const moe_cpu_features *f = moe_cpu_get_features();
    if ((unsigned)isa > MOE_ISA_AMX) return moe_errf(err, MOE_ERR_ARG, "unknown ISA value %d", (int)isa);
    if (!available(isa, f)) {
        char have[64] = "ref";
        if (have_avx2(f)) strcat(have, ", avx2");
        if (have_avx512(f)) strcat(have, ", avx512");
        if (have_amx(f)) strcat(have, ", amx");
        const char *why = "";
        if (isa == MOE_ISA_AMX)
            why = f->amx_denied                          ? " (the CPU has AMX; Linux refused the tile data state)"
                  : !(f->amx_tile && f->amx_bf16)        ? " (no AMX-TILE/AMX-BF16 on this CPU)"
                  : !(have_avx512(f) && f->avx512bf16)   ? " (AMX needs AVX-512 with BF16 too)"
                                                         : " (this build has no AMX kernels: the compiler lacked -mamx-tile)";
        else if (isa == MOE_ISA_AVX512)
            why = " (needs AVX-512 F/BW/VL/DQ/VBMI, FMA, F16C and the OS's ZMM state)";
        else if (isa == MOE_ISA_AVX2)
            why = " (needs AVX2, FMA, F16C and the OS's YMM state)";
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "ISA \"%s\" is not available on this CPU or in this build%s; available: %s",
                        moe_isa_name(isa), why, have);
    }
    *out = isa != MOE_ISA_AUTO ? isa : have_avx512(f) ? MOE_ISA_AVX512 : have_avx2(f) ? MOE_ISA_AVX2 : MOE_ISA_REF;
    return MOE_OK;
}

moe_status moe_cpu_table(moe_isa isa, const moe_cpu_kernels **k, moe_error *err) {
    MOE_ASSERT(k);
    moe_isa got = MOE_ISA_REF; /* set by moe_isa_resolve; initialized for gcc -O3 -Wmaybe-uninitialized */
    moe_status st = moe_isa_resolve(isa, &got, err);
    if (st != MOE_OK) return st;
    const moe_cpu_features *f = moe_cpu_get_features();
    *k = got == MOE_ISA_AMX    ? moe_cpu_amx_table()
       : got == MOE_ISA_AVX512 ? moe_cpu_avx512_table(f->avx512bf16)
       : got == MOE_ISA_AVX2   ? moe_cpu_avx2_table()
                               : moe_cpu_ref();
    return MOE_OK;
}
