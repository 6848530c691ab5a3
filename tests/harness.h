/* Minimal test harness: every CHECK counts; a test binary ends by printing
 * "N passed, N failed" and exits non-zero when anything failed. */
#ifndef MOE_TEST_HARNESS_H
#define MOE_TEST_HARNESS_H

#include "moeaudit.h"
#include <stdio.h>

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

#endif
