/*
 * The one CPU feature detector: cpuid and xgetbv, read once. The kernel
 * tables (src/cpu/dispatch.c) and the fast quantizers (src/formats) both ask
 * it; nothing else probes the CPU.
 *
 * Invariants:
 *  1. The features are facts of the machine: detected once (pthread_once),
 *     never changed afterwards, so every reader sees the same answer.
 *  2. A feature counts only when the OS enables its register state too
 *     (XCR0: YMM for AVX/AVX2, opmask + ZMM for AVX-512, tiles for AMX).
 *     For AMX, Linux also has to grant the tile data state to the process:
 *     detection asks once (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA);
 *     without it the first tile instruction faults); when it refuses, the
 *     AMX features read false and amx_denied says why.
 */
#define _GNU_SOURCE 1 /* syscall() for arch_prctl */
#include "core/core.h"

#include <pthread.h>
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
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

#if MOE_X86
static uint64_t moe_xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

/* Ask Linux for the AMX tile data state (once per process); true when
 * granted, or already granted. */
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

static void detect(void) {
    moe_cpu_features *f = &g_feat;
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
            if (f->amx_tile && !request_amx_state()) {
                f->amx_tile = f->amx_bf16 = f->amx_int8 = false;
                f->amx_denied = true;
            }
            unsigned max_sub = a;
            if (max_sub >= 1) {
                __cpuid_count(7, 1, a, b, c, d);
                f->avx512bf16 = (a >> 5) & 1;
            }
        }
    }
#endif
}

const moe_cpu_features *moe_cpu_get_features(void) {
    pthread_once(&g_once, detect);
    return &g_feat;
}
