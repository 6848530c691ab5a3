/*
 * Internal core helpers: assertions, error messages, allocation.
 *
 * Invariants of the library (hold after every public call returns):
 *  1. The library never prints and never exits; contract violations by the
 *     caller (NULL where forbidden, impossible enum) go through MOE_ASSERT,
 *     which stays on in release builds.
 *  2. A failing call leaves its outputs either untouched or freed, and fills
 *     err->msg (when err != NULL) with the file, tensor and value at fault.
 */
#ifndef MOE_CORE_H
#define MOE_CORE_H

#include "moeaudit.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#if defined(__GNUC__)
#define MOE_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MOE_PRINTF(a, b)
#endif

void moe_assert_fail(const char *expr, const char *file, int line);

#define MOE_ASSERT(x) \
    do { if (!(x)) moe_assert_fail(#x, __FILE__, __LINE__); } while (0)

/* Fill err (if any) and return s, so that `return moe_errf(err, S, ...)`. */
moe_status moe_errf(moe_error *err, moe_status s, const char *fmt, ...) MOE_PRINTF(3, 4);

/* Shorten msg [len + 1] in place to at most cap - 1 bytes (cap >= 16) so
 * that nothing a reader needs is lost: long space-free runs (paths) lose
 * their middle first ("/a/very/lo...dir/config.json"), then, if still too
 * long, the message its middle. Returns the new length. moe_errf applies it
 * to every message longer than moe_error's buffer. */
size_t moe_err_fit(char *msg, size_t len, size_t cap);

/* dir + "/" + file in a new string (trailing slashes of dir dropped), or NULL
 * when out of memory. Never truncates. */
char *moe_path_join(const char *dir, const char *file);

/* calloc that checks n * size for overflow. */
void *moe_calloc(size_t n, size_t size);
void *moe_malloc(size_t n, size_t size);

/* s (NULL: nothing) to f with < > & " as HTML entities (the reports' HTML). */
void moe_html_esc(FILE *f, const char *s);

/* n * m with overflow detection; false on overflow. */
static inline int moe_mul_ok(uint64_t a, uint64_t b, uint64_t *out) {
    if (a != 0 && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* What this CPU and OS support (cpuid + xgetbv; src/core/cpuid.c, the one
 * detector). Detected once; the pointer stays valid and constant. */
typedef struct moe_cpu_features {
    bool avx2, fma, f16c;
    bool avx512f, avx512bw, avx512vl, avx512dq, avx512bf16, avx512vbmi;
    bool os_avx, os_avx512;     /* XCR0 enables the register state */
    bool amx_tile, amx_bf16, amx_int8;  /* CPU, XCR0 and Linux's tile data permission */
    bool amx_denied;            /* the CPU and XCR0 have AMX, Linux refused the tile data state */
} moe_cpu_features;

const moe_cpu_features *moe_cpu_get_features(void);

/* Scalar conversions used on every path (exact). */
static inline float moe_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
float moe_f16_to_f32(uint16_t h);

#endif
