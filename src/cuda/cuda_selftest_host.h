/*
 * Host-side helpers shared by the device self-tests in the src/cuda .cu files (C++,
 * host code only; not part of the library's interface): the message writer
 * and the pseudo-random generator their inputs come from.
 */
#ifndef MOE_CUDA_SELFTEST_HOST_H
#define MOE_CUDA_SELFTEST_HOST_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* Append printf-style text to msg [n] at *used; msg stays NUL-terminated
 * and text past its end is dropped (msg NULL or full: nothing). */
static inline void moe_st_put(char *msg, size_t n, size_t *used, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static inline void moe_st_put(char *msg, size_t n, size_t *used, const char *fmt, ...) {
    if (!msg || *used + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(msg + *used, n - *used, fmt, ap);
    va_end(ap);
    if (k > 0) *used = *used + (size_t)k < n ? *used + (size_t)k : n - 1;
}

/* xorshift64 (shifts 13, 7, 17); next() returns bits 11..42 of the state.
 * Each self-test keeps its own seeded instance, so its inputs do not depend
 * on which other self-test ran first. */
struct moe_st_rng {
    uint64_t s;
    uint32_t next() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        return (uint32_t)(s >> 11);
    }
};

#endif
