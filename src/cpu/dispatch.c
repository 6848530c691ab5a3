/*
 * CPU detection and the kernel tables by name.
 *
 * Invariants:
 *  1. Detection runs once (pthread_once): cpuid and xgetbv for the
 *     instruction sets and the register state the OS saves, and, when the
 *     CPU has AMX, one arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) asking
 *     Linux for the tile data state (granted per process; without it the
 *     first tile instruction faults). The results never change afterwards.
 *  2. A name resolves to its table only when every feature the table's code
 *     uses is present (have_*): ref always; avx2 = AVX2 + FMA + F16C + YMM
 *     state; avx512 = F/BW/VL/DQ/VBMI + FMA + F16C + ZMM state (gemm_bf16act
 *     set iff AVX512_BF16 too); amx = avx512 with AVX512_BF16 + AMX-TILE +
 *     AMX-BF16 + tile state permitted + an AMX build. Every table starts as
 *     the reference table and is overridden entry by entry.
 *  3. The default table is MOE_ISA's when set (an unknown or unsupported
 *     value is an error of moe_cpu_kernels_for, never silently replaced),
 *     else the first present of avx512, amx, avx2, ref (best_table says why
 *     avx512 comes before amx).
 *  4. moe_cpu_active starts at the default (the best when MOE_ISA is bad);
 *     moe_cpu_select swaps one atomic pointer; kernels already running keep
 *     the table they loaded.
 */
#define _GNU_SOURCE 1 /* syscall() for arch_prctl */
#include "cpu/cpu_internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define MOE_X86 1
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#define MOE_ARCH_GET_XCOMP_PERM 0x1022
#define MOE_ARCH_REQ_XCOMP_PERM 0x1023
#define MOE_XFEATURE_XTILEDATA 18
#endif

static moe_cpu_features g_feat;
static const moe_cpu_kernels *g_default; /* MOE_ISA's or the best; set once */
static char g_available[64];             /* "amx avx512 avx2 ref" (those present) */
static _Atomic(const moe_cpu_kernels *) g_active;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#if MOE_X86
static uint64_t moe_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

/* Ask Linux for the AMX tile data state (once per process); true when
 * granted (or already granted). */
static bool request_amx_state(void) {
#if defined(MOE_ARCH_REQ_XCOMP_PERM)
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, MOE_ARCH_REQ_XCOMP_PERM, MOE_XFEATURE_XTILEDATA) != 0) return false;
    if (syscall(SYS_arch_prctl, MOE_ARCH_GET_XCOMP_PERM, &bits) != 0) return false;
    return (bits >> MOE_XFEATURE_XTILEDATA) & 1;
#else
    return false;
#endif
}

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
            f->amx_bf16 = (d >> 22) & 1;
            f->amx_tile = (d >> 24) & 1;
            f->amx_int8 = (d >> 25) & 1;
            f->os_amx = os_amx && f->amx_tile && request_amx_state();
            unsigned max_sub = a;
            if (max_sub >= 1) {
                __cpuid_count(7, 1, a, b, c, d);
                f->avx512bf16 = (a >> 5) & 1;
            }
        }
    }
#endif
}

static bool have_avx512(const moe_cpu_features *f) {
    return f->os_avx512 && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->avx512vbmi &&
           f->fma && f->f16c;
}

static bool have_avx2(const moe_cpu_features *f) { return f->os_avx && f->avx2 && f->fma && f->f16c; }

static bool have_amx(const moe_cpu_features *f) {
    return have_avx512(f) && f->avx512bf16 && f->amx_tile && f->amx_bf16 && f->os_amx && moe_cpu_amx_table() != NULL;
}

/* The table of a known name when this CPU has it, else NULL. */
static const moe_cpu_kernels *table_if_present(const char *isa) {
    if (strcmp(isa, "ref") == 0) return moe_cpu_ref();
    if (strcmp(isa, "avx2") == 0) return have_avx2(&g_feat) ? moe_cpu_avx2_table() : NULL;
    if (strcmp(isa, "avx512") == 0) return have_avx512(&g_feat) ? moe_cpu_avx512_table(g_feat.avx512bf16) : NULL;
    if (strcmp(isa, "amx") == 0) return have_amx(&g_feat) ? moe_cpu_amx_table() : NULL;
    return NULL;
}

static bool known_isa(const char *isa) {
    return !strcmp(isa, "ref") || !strcmp(isa, "avx2") || !strcmp(isa, "avx512") || !strcmp(isa, "amx");
}

/* "missing X, Y" for a known name this CPU lacks (buf). */
static const char *missing_features(const char *isa, char *buf, size_t cap) {
    const moe_cpu_features *f = &g_feat;
    buf[0] = 0;
#define MISS(cond, name)                                                                   \
    do {                                                                                   \
        if (!(cond)) snprintf(buf + strlen(buf), cap - strlen(buf), "%s%s", buf[0] ? ", " : "", name); \
    } while (0)
    if (!strcmp(isa, "avx2")) {
        MISS(f->avx2, "AVX2");
        MISS(f->fma, "FMA");
        MISS(f->f16c, "F16C");
        MISS(f->os_avx, "OS support for the YMM state");
    } else {
        MISS(f->avx512f, "AVX512F");
        MISS(f->avx512bw, "AVX512BW");
        MISS(f->avx512vl, "AVX512VL");
        MISS(f->avx512dq, "AVX512DQ");
        MISS(f->avx512vbmi, "AVX512_VBMI");
        MISS(f->fma, "FMA");
        MISS(f->f16c, "F16C");
        MISS(f->os_avx512, "OS support for the ZMM state");
        if (!strcmp(isa, "amx")) {
            MISS(f->avx512bf16, "AVX512_BF16");
            MISS(f->amx_tile, "AMX-TILE");
            MISS(f->amx_bf16, "AMX-BF16");
            if (f->amx_tile) MISS(f->os_amx, "the OS's permission for the AMX tile state (arch_prctl)");
            MISS(moe_cpu_amx_table() != NULL, "AMX kernels in this build (the compiler lacked -mamx-tile)");
        }
    }
#undef MISS
    return buf;
}

/* Resolve a name (never NULL here); `from_env` only changes the message. */
static moe_status resolve(const char *isa, bool from_env, const moe_cpu_kernels **out, moe_error *err) {
    const char *pre = from_env ? "MOE_ISA=" : "", *q = from_env ? "" : "\"";
    if (!known_isa(isa))
        return moe_errf(err, MOE_ERR_ARG, "unknown CPU kernel path %s%s%s%s (known: ref, avx2, avx512, amx; this CPU has: %s)",
                        pre, q, isa, q, g_available);
    const moe_cpu_kernels *t = table_if_present(isa);
    if (!t) {
        char miss[256];
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "CPU kernel path %s%s%s%s is not available here: missing %s (this CPU has: %s)",
                        pre, q, isa, q, missing_features(isa, miss, sizeof miss), g_available);
    }
    *out = t;
    return MOE_OK;
}

/* The default without MOE_ISA. avx512 before amx: the two run the same f32
 * kernels; with bf16 activations the AMX tiles measured 3.6-4.8x faster than
 * vdpbf16ps at T >= 1024 tokens per block but 2.4-3x slower at T <= 128 on a
 * 16-core Xeon (docs/performance.md), and a table may not switch on T
 * (kernels.h, contract 2), so the tiles are the choice of those who run
 * large batches: MOE_ISA=amx. */
static const moe_cpu_kernels *best_table(void) {
    static const char *const order[] = {"avx512", "amx", "avx2", "ref"};
    for (int i = 0; i < 4; i++) {
        const moe_cpu_kernels *t = table_if_present(order[i]);
        if (t) return t;
    }
    return moe_cpu_ref();
}

static void init_once(void) {
    detect(&g_feat);
    static const char *const order[] = {"amx", "avx512", "avx2", "ref"};
    g_available[0] = 0;
    for (int i = 0; i < 4; i++)
        if (table_if_present(order[i]))
            snprintf(g_available + strlen(g_available), sizeof g_available - strlen(g_available), "%s%s",
                     g_available[0] ? " " : "", order[i]);
    const moe_cpu_kernels *d = best_table();
    const char *env = getenv("MOE_ISA");
    if (env && *env) {
        const moe_cpu_kernels *t = NULL;
        if (resolve(env, true, &t, NULL) == MOE_OK) d = t;
    }
    g_default = d;
    atomic_store(&g_active, d);
}

const moe_cpu_features *moe_cpu_get_features(void) {
    pthread_once(&g_once, init_once);
    return &g_feat;
}

const char *moe_cpu_available(void) {
    pthread_once(&g_once, init_once);
    return g_available;
}

moe_status moe_cpu_kernels_for(const char *isa, const moe_cpu_kernels **out, moe_error *err) {
    pthread_once(&g_once, init_once);
    if (!out) return moe_errf(err, MOE_ERR_ARG, "moe_cpu_kernels_for: out is NULL");
    if (isa && *isa) return resolve(isa, false, out, err);
    const char *env = getenv("MOE_ISA");
    if (env && *env) return resolve(env, true, out, err);
    *out = g_default;
    return MOE_OK;
}

const moe_cpu_kernels *moe_cpu_active(void) {
    pthread_once(&g_once, init_once);
    return atomic_load(&g_active);
}

moe_status moe_cpu_select(const char *isa, moe_error *err) {
    pthread_once(&g_once, init_once);
    if (!isa) return moe_errf(err, MOE_ERR_ARG, "moe_cpu_select: isa is NULL");
    const moe_cpu_kernels *t = NULL;
    moe_status st = resolve(isa, false, &t, err);
    if (st != MOE_OK) return st;
    atomic_store(&g_active, t);
    return MOE_OK;
}
