/*
 * CPU detection and the active kernel table.
 *
 * Invariants:
 *  1. The active table is chosen once (pthread_once): MOE_ISA from the
 *     environment if it names a path this CPU supports, else the best path
 *     (avx512 when present, else avx2, else ref).
 *     An unknown or unsupported MOE_ISA value leaves the best path active
 *     (the library cannot print; callers see the choice in ->isa).
 *  2. Every table starts as the reference table and is overridden entry by
 *     entry, so an entry an ISA lacks is the reference one. gemm_bf16act is
 *     set only on the avx512 table of a CPU with AVX512_BF16 (cpuid leaf 7
 *     subleaf 1, EAX bit 5); elsewhere it is NULL.
 *  3. moe_cpu_select swaps one atomic pointer; kernels already running keep
 *     the table they loaded.
 */
#include "cpu/cpu_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MOE_X86 1
#endif

static moe_cpu_features g_feat;
static _Atomic(const moe_cpu_kernels *) g_active;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#if MOE_X86
static uint64_t moe_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

static void detect(moe_cpu_features *f) {
    memset(f, 0, sizeof *f);
#if MOE_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    bool osxsave = (c >> 27) & 1;
    f->fma = (c >> 12) & 1;
    f->f16c = (c >> 29) & 1;
    if (osxsave) {
        uint64_t xcr0 = moe_xgetbv0();
        f->os_avx = (xcr0 & 0x6) == 0x6;              /* XMM | YMM */
        f->os_avx512 = (xcr0 & 0xE6) == 0xE6;         /* + opmask, ZMM_Hi256, Hi16_ZMM */
        bool os_amx = (xcr0 & 0x60000) == 0x60000;    /* XTILECFG | XTILEDATA */
        if (__get_cpuid_max(0, NULL) >= 7) {
            __cpuid_count(7, 0, a, b, c, d);
            f->avx2 = (b >> 5) & 1;
            f->avx512f = (b >> 16) & 1;
            f->avx512dq = (b >> 17) & 1;
            f->avx512bw = (b >> 30) & 1;
            f->avx512vl = (b >> 31) & 1;
            f->avx512vbmi = (c >> 1) & 1;
            f->amx_bf16 = os_amx && ((d >> 22) & 1);
            f->amx_tile = os_amx && ((d >> 24) & 1);
            f->amx_int8 = os_amx && ((d >> 25) & 1);
            unsigned max_sub = a;
            if (max_sub >= 1) {
                __cpuid_count(7, 1, a, b, c, d);
                f->avx512bf16 = (a >> 5) & 1;
            }
        }
    }
#endif
}

const moe_cpu_features *moe_cpu_get_features(void);

static bool have_avx512(const moe_cpu_features *f) {
    return f->os_avx512 && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->avx512vbmi &&
           f->fma && f->f16c;
}

static bool have_avx2(const moe_cpu_features *f) { return f->os_avx && f->avx2 && f->fma && f->f16c; }

/* The best table this CPU supports: avx512, else avx2, else ref. */
static const moe_cpu_kernels *best_table(const moe_cpu_features *f) {
    if (have_avx512(f)) return moe_cpu_avx512_table(f->avx512bf16);
    if (have_avx2(f)) return moe_cpu_avx2_table();
    return moe_cpu_ref();
}

/* The table for `isa`, or NULL when this CPU or build lacks it. */
static const moe_cpu_kernels *table_for(const char *isa) {
    if (strcmp(isa, "ref") == 0) return moe_cpu_ref();
    if (strcmp(isa, "avx512") == 0) return have_avx512(&g_feat) ? moe_cpu_avx512_table(g_feat.avx512bf16) : NULL;
    if (strcmp(isa, "avx2") == 0) return have_avx2(&g_feat) ? moe_cpu_avx2_table() : NULL;
    /* "amx": detected (moe_cpu_get_features) but no AMX kernels are built:
     * this project's machine has none to test them on. */
    return NULL;
}

static void init_once(void) {
    detect(&g_feat);
    const moe_cpu_kernels *best = best_table(&g_feat);
    const char *env = getenv("MOE_ISA");
    if (env && *env) {
        const moe_cpu_kernels *t = table_for(env);
        if (t) best = t;
    }
    atomic_store(&g_active, best);
}

const moe_cpu_features *moe_cpu_get_features(void) {
    pthread_once(&g_once, init_once);
    return &g_feat;
}

const moe_cpu_kernels *moe_cpu_active(void) {
    pthread_once(&g_once, init_once);
    return atomic_load(&g_active);
}

moe_status moe_cpu_select(const char *isa, moe_error *err) {
    pthread_once(&g_once, init_once);
    if (!isa) return moe_errf(err, MOE_ERR_ARG, "moe_cpu_select: isa is NULL");
    const moe_cpu_kernels *t = table_for(isa);
    if (!t) {
        if (strcmp(isa, "avx512") == 0 || strcmp(isa, "avx2") == 0 || strcmp(isa, "amx") == 0)
            return moe_errf(err, MOE_ERR_UNSUPPORTED,
                            "moe_cpu_select: ISA path \"%s\" is not available on this CPU or in this build%s", isa,
                            strcmp(isa, "amx") == 0 ? (g_feat.amx_tile ? " (AMX detected; no AMX kernels built)"
                                                                        : " (no AMX on this CPU)")
                                                    : "");
        return moe_errf(err, MOE_ERR_ARG, "moe_cpu_select: unknown ISA \"%s\" (ref, avx2, avx512, amx)", isa);
    }
    atomic_store(&g_active, t);
    return MOE_OK;
}
