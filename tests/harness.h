/* Minimal test harness: every CHECK counts; a test binary ends by printing
 * "N passed, N failed" and exits non-zero when anything failed. */
#ifndef MOE_TEST_HARNESS_H
#define MOE_TEST_HARNESS_H

#include "moeaudit.h"
#include "core/core.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

extern int moe_t_pass, moe_t_fail;

#define CHECK(cond, ...)                                                     \
    do {                                                                     \
        if (cond) {                                                          \
            moe_t_pass++;                                                    \
        } else {                                                             \
            moe_t_fail++;                                                    \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);  \
            fprintf(stderr, __VA_ARGS__);                                    \
            fputc('\n', stderr);                                             \
        }                                                                    \
    } while (0)

/* CHECK that a status is MOE_OK, printing the error message otherwise. */
#define CHECK_OK(st, err) CHECK((st) == MOE_OK, "%s: %s", moe_status_str(st), (err).msg)

typedef void (*moe_test_fn)(void);
#define RUN(fn) moe_t_run(#fn, fn)
void moe_t_run(const char *name, moe_test_fn fn);
int moe_t_finish(void);

/* Read-only data path: tests/data/<rel>. Static buffer, one at a time. */
const char *moe_t_data(const char *rel);
/* A fresh scratch directory for this test binary (removed by the OS tmp policy). */
const char *moe_t_tmpdir(void);

/* buf = "<moe_t_tmpdir()>/<name>" (at most cap bytes); returns buf. */
static inline const char *moe_t_tmp_path(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/%s", moe_t_tmpdir(), name);
    return buf;
}

/* Temporary files of the atomic writer (".<name>.tmp.<random>") in dir: a
 * failed or finished write must leave none. -1 when dir cannot be listed. */
int moe_t_count_temps(const char *dir);

/* --------------------------------------------------------- random numbers */

/* Uniform in [0, 1): the top 53 bits of the next splitmix64 draw. */
static inline double moe_t_rng_unif(uint64_t *s) { return (double)(moe_splitmix64(s) >> 11) * 0x1.0p-53; }

/* N(0, 1) by Box-Muller from two moe_t_rng_unif draws (not the same numbers
 * as moeaudit.h's moe_splitmix64_gauss4). */
static inline double moe_t_rng_normal(uint64_t *s) {
    double u1 = moe_t_rng_unif(s), u2 = moe_t_rng_unif(s);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* ------------------------------------------------------ safetensors files */

/* Number of elements of t (the product of its shape). */
static inline int64_t moe_t_numel(const moe_st_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* All of t widened to double, in a new buffer (caller frees); *n_out (when
 * not NULL) = its element count. */
static inline double *moe_t_tensor_f64(const moe_st_tensor *t, int64_t *n_out) {
    int64_t n = moe_t_numel(t);
    double *v = malloc((size_t)n * sizeof *v + 1);
    for (int64_t i = 0; i < n; i++) v[i] = moe_load_f64(t->data, t->dtype, (size_t)i);
    if (n_out) *n_out = n;
    return v;
}

/* All of t as int64, in a new buffer (caller frees). */
static inline int64_t *moe_t_tensor_i64(const moe_st_tensor *t) {
    int64_t n = moe_t_numel(t);
    int64_t *v = malloc((size_t)n * sizeof *v + 1);
    for (int64_t i = 0; i < n; i++) v[i] = moe_load_i64(t->data, t->dtype, (size_t)i);
    return v;
}

/* Tensor `name` of f as moe_t_tensor_f64, or NULL when f has no such tensor. */
static inline double *moe_t_load_f64(moe_st_file *f, const char *name, int64_t *n_out) {
    const moe_st_tensor *t = moe_st_find(f, name);
    return t ? moe_t_tensor_f64(t, n_out) : NULL;
}

/* An entry that writes t again as it is (same name, dtype, shape and data). */
static inline moe_st_entry moe_t_st_entry(const moe_st_tensor *t) {
    moe_st_entry e;
    memset(&e, 0, sizeof e);
    e.name = t->name;
    e.dtype = t->dtype;
    e.ndim = t->ndim;
    memcpy(e.shape, t->shape, sizeof t->shape);
    e.data = t->data;
    return e;
}

/* ------------------------------------------------ text files and commands */

/* Read at most cap - 1 bytes of fp into buf and NUL-terminate; returns the count. */
static inline size_t moe_t_read_into(FILE *fp, char *buf, size_t cap) {
    size_t n = fread(buf, 1, cap - 1, fp);
    buf[n] = 0;
    return n;
}

/* The file at path into buf as moe_t_read_into; buf, or NULL (buf untouched)
 * when it cannot be opened. */
static inline char *moe_t_read_file(const char *path, char *buf, size_t cap) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    moe_t_read_into(fp, buf, cap);
    fclose(fp);
    return buf;
}

/* Run cmd through the shell, its standard output into out as moe_t_read_into;
 * returns the exit code, or -1 when it could not run or did not exit. */
static inline int moe_t_sh(const char *cmd, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    moe_t_read_into(p, out, cap);
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* The length snprintf returned for cmd [cap]: a command that did not fit is
 * a defect of the test, never run cut short (exits 1, naming it). Usage:
 * moe_t_fits(cmd, sizeof cmd, snprintf(cmd, sizeof cmd, ...)); using the
 * return value is also what keeps gcc's -Wformat-truncation quiet. */
static inline const char *moe_t_fits(const char *cmd, size_t cap, int n) {
    if (n < 0 || (size_t)n >= cap) {
        fprintf(stderr, "test: command longer than %zu bytes: %.80s...\n", cap, cmd);
        exit(1);
    }
    return cmd;
}

#endif
