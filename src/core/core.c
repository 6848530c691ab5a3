#include "core/core.h"

#include <math.h>
#include <string.h>

void moe_assert_fail(const char *expr, const char *file, int line) {
    /* The one place the library writes to stderr: a broken caller contract
     * cannot be reported through a status. */
    fprintf(stderr, "moeaudit: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

/* Shorten msg [len] in place to at most cap - 1 bytes, keeping what a reader
 * needs: the longest space-free runs (paths, long names) lose their middle
 * first, each down to MOE_FIT_KEEP bytes with "..." in place of what went;
 * only when that is not enough does the message as a whole lose its middle.
 * So a 4000-byte path keeps its start and its file name, and the cause after
 * it ("No such file or directory") survives. */
#define MOE_FIT_KEEP 64
size_t moe_err_fit(char *msg, size_t len, size_t cap) {
    MOE_ASSERT(cap >= 16);
    while (len > cap - 1) {
        size_t best = 0, best_len = 0;
        for (size_t i = 0; i < len;) {
            if (msg[i] == ' ') { i++; continue; }
            size_t j = i;
            while (j < len && msg[j] != ' ') j++;
            if (j - i > best_len) { best = i; best_len = j - i; }
            i = j;
        }
        if (best_len <= MOE_FIT_KEEP) break;
        size_t excess = len - (cap - 1);
        size_t keep = best_len > excess + MOE_FIT_KEEP ? best_len - excess : MOE_FIT_KEEP;
        /* of what stays, 2/5 from the head of the run and 3/5 from its tail
         * (a path's file name is at its end) */
        size_t head = (keep - 3) * 2 / 5, tail = keep - 3 - head;
        char *from = msg + best + best_len - tail;
        memcpy(msg + best + head, "...", 3);
        memmove(msg + best + head + 3, from, (size_t)(msg + len - from));
        len -= best_len - (head + 3 + tail);
    }
    if (len > cap - 1) { /* many short words: drop the middle of the message */
        size_t head = (cap - 1) / 3, tail = cap - 1 - head - 5;
        memcpy(msg + head, " ... ", 5);
        memmove(msg + head + 5, msg + len - tail, tail);
        len = cap - 1;
    }
    msg[len] = '\0';
    return len;
}

moe_status moe_errf(moe_error *err, moe_status s, const char *fmt, ...) {
    if (!err) return s;
    /* Formatted into a scratch buffer first: arguments may point into
     * err->msg (a message extended with context). */
    char small[sizeof err->msg];
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) {
        snprintf(err->msg, sizeof err->msg, "(message could not be formatted: %s)", fmt);
    } else if ((size_t)n < sizeof small) {
        memcpy(err->msg, small, (size_t)n + 1);
    } else {
        char *full = malloc((size_t)n + 1);
        if (full) {
            vsnprintf(full, (size_t)n + 1, fmt, ap2);
            size_t l = moe_err_fit(full, (size_t)n, sizeof err->msg);
            memcpy(err->msg, full, l + 1);
            free(full);
        } else { /* no memory for the whole: keep the head, marked as cut */
            memcpy(err->msg, small, sizeof small);
            memcpy(err->msg + sizeof err->msg - 5, " ...", 5);
        }
    }
    va_end(ap2);
    return s;
}

void *moe_calloc(size_t n, size_t size) {
    if (n == 0 || size == 0) return calloc(1, 1);
    if (n > SIZE_MAX / size) return NULL;
    return calloc(n, size);
}

void *moe_malloc(size_t n, size_t size) {
    if (n == 0 || size == 0) return malloc(1);
    if (n > SIZE_MAX / size) return NULL;
    return malloc(n * size);
}

const char *moe_status_str(moe_status s) {
    switch (s) {
    case MOE_OK: return "ok";
    case MOE_ERR_IO: return "i/o error";
    case MOE_ERR_FORMAT: return "malformed file";
    case MOE_ERR_MISSING: return "missing tensor or key";
    case MOE_ERR_SHAPE: return "wrong shape";
    case MOE_ERR_DTYPE: return "wrong dtype";
    case MOE_ERR_CONFIG: return "invalid config";
    case MOE_ERR_INPUT: return "invalid input";
    case MOE_ERR_NOMEM: return "out of memory";
    case MOE_ERR_INVARIANT: return "scaling contract violated";
    case MOE_ERR_UNSUPPORTED: return "unsupported";
    case MOE_ERR_ARG: return "invalid argument";
    }
    return "unknown status";
}

/* IEEE half to float, exact (subnormals, Inf, NaN kept). */
float moe_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (e == 0x1f) {
        v.u = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
        float f = ldexpf((float)m, -24);
        return sign ? -f : f;
    } else {
        v.u = sign | ((e + 112) << 23) | (m << 13);
    }
    return v.f;
}

/* ------------------------------------------------------------------ dtypes */

static const struct { const char *name; size_t size; } dtype_tab[MOE_DTYPE_COUNT] = {
    [MOE_DTYPE_BOOL] = {"BOOL", 1},   [MOE_DTYPE_U8] = {"U8", 1},
    [MOE_DTYPE_I8] = {"I8", 1},       [MOE_DTYPE_U16] = {"U16", 2},
    [MOE_DTYPE_I16] = {"I16", 2},     [MOE_DTYPE_U32] = {"U32", 4},
    [MOE_DTYPE_I32] = {"I32", 4},     [MOE_DTYPE_U64] = {"U64", 8},
    [MOE_DTYPE_I64] = {"I64", 8},     [MOE_DTYPE_F16] = {"F16", 2},
    [MOE_DTYPE_BF16] = {"BF16", 2},   [MOE_DTYPE_F32] = {"F32", 4},
    [MOE_DTYPE_F64] = {"F64", 8},     [MOE_DTYPE_F8_E4M3] = {"F8_E4M3", 1},
    [MOE_DTYPE_F8_E5M2] = {"F8_E5M2", 1}, [MOE_DTYPE_F8_E8M0] = {"F8_E8M0", 1},
};

size_t moe_dtype_size(moe_dtype t) {
    MOE_ASSERT((unsigned)t < MOE_DTYPE_COUNT);
    return dtype_tab[t].size;
}

const char *moe_dtype_name(moe_dtype t) {
    if ((unsigned)t >= MOE_DTYPE_COUNT) return "?";
    return dtype_tab[t].name;
}

bool moe_dtype_from_name(const char *name, moe_dtype *out) {
    for (int i = 0; i < MOE_DTYPE_COUNT; i++) {
        if (strcmp(name, dtype_tab[i].name) == 0) { *out = (moe_dtype)i; return true; }
    }
    if (strcmp(name, "E8M0") == 0) { *out = MOE_DTYPE_F8_E8M0; return true; }
    return false;
}

bool moe_dtype_is_float(moe_dtype t) {
    return t == MOE_DTYPE_F64 || t == MOE_DTYPE_F32 || t == MOE_DTYPE_F16 || t == MOE_DTYPE_BF16;
}

bool moe_dtype_is_int(moe_dtype t) {
    return t == MOE_DTYPE_I8 || t == MOE_DTYPE_I16 || t == MOE_DTYPE_I32 || t == MOE_DTYPE_I64 ||
           t == MOE_DTYPE_U8 || t == MOE_DTYPE_U16 || t == MOE_DTYPE_U32 || t == MOE_DTYPE_U64;
}

/* Loads go through memcpy: mapped tensors need not be aligned. */
double moe_load_f64(const void *data, moe_dtype t, size_t i) {
    const unsigned char *p = data;
    switch (t) {
    case MOE_DTYPE_F64: { double v; memcpy(&v, p + 8 * i, 8); return v; }
    case MOE_DTYPE_F32: { float v; memcpy(&v, p + 4 * i, 4); return v; }
    case MOE_DTYPE_F16: { uint16_t h; memcpy(&h, p + 2 * i, 2); return moe_f16_to_f32(h); }
    case MOE_DTYPE_BF16: { uint16_t h; memcpy(&h, p + 2 * i, 2); return moe_bf16_to_f32(h); }
    default: MOE_ASSERT(!"moe_load_f64 on a non-float dtype");
    }
    return 0;
}

int64_t moe_load_i64(const void *data, moe_dtype t, size_t i) {
    const unsigned char *p = data;
    switch (t) {
    case MOE_DTYPE_I8: return (int8_t)p[i];
    case MOE_DTYPE_U8: return p[i];
    case MOE_DTYPE_I16: { int16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case MOE_DTYPE_U16: { uint16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case MOE_DTYPE_I32: { int32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    case MOE_DTYPE_U32: { uint32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    case MOE_DTYPE_I64: { int64_t v; memcpy(&v, p + 8 * i, 8); return v; }
    case MOE_DTYPE_U64: { uint64_t v; memcpy(&v, p + 8 * i, 8); return v > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)v; }
    default: MOE_ASSERT(!"moe_load_i64 on a non-integer dtype");
    }
    return 0;
}

char *moe_path_join(const char *dir, const char *file) {
    size_t dl = strlen(dir), fl = strlen(file);
    while (dl > 1 && dir[dl - 1] == '/') dl--;
    char *p = malloc(dl + 1 + fl + 1);
    if (!p) return NULL;
    memcpy(p, dir, dl);
    p[dl] = '/';
    memcpy(p + dl + 1, file, fl + 1);
    return p;
}

void moe_html_esc(FILE *f, const char *s) {
    for (; s && *s; s++) {
        if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '&') fputs("&amp;", f);
        else if (*s == '"') fputs("&quot;", f);
        else fputc(*s, f);
    }
}
