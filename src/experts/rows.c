/*
 * One expert over gathered rows: the unit every driver runs (the CPU block
 * per chunk, MPI on the holder rank). Gather the rows, round them to the
 * activation precision, run the SwiGLU expert in the path's precision,
 * scatter the outputs.
 *
 * Invariants:
 *  1. Row q's output depends on row q alone (the kernels' contract), so
 *     which rows share a call, and in which order, changes no bit: the CPU
 *     and MPI drivers get identical outputs for one (token, column).
 *  2. The scratch is allocated here, per call, and freed before returning;
 *     the kernels below never allocate.
 */
#include "experts/experts.h"
#include "core/core.h"
#include "experts/experts_fast.h"
#include "formats/act.h"

#include <string.h>

moe_status moe_expert_rows(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit, bool f32,
                           moe_act_prec act, const moe_cpu_kernels *k, int H, int64_t n, const void *src,
                           const int64_t *src_idx, void *dst, const int64_t *dst_idx, moe_error *err) {
    if (n == 0) return MOE_OK;
    MOE_ASSERT(!f32 || k);
    int64_t I = w1->rows;
    size_t xs = (size_t)n * (size_t)H, ss = f32 ? moe_expert_fast_scratch(H, I, n) : moe_expert_scratch(H, I, n);
    size_t es = f32 ? sizeof(float) : sizeof(double), row = (size_t)H * es;
    char *buf = moe_malloc(2 * xs + ss, es);
    if (!buf) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for expert %s (%lld rows)", w1->name, (long long)n);
    char *X = buf, *Yo = buf + xs * es, *scr = Yo + xs * es;
    for (int64_t q = 0; q < n; q++) {
        memcpy(X + (size_t)q * row, (const char *)src + (size_t)(src_idx ? src_idx[q] : q) * row, row);
        if (f32) moe_act_round_f32(act, (float *)(void *)X + q * H, H);
        else moe_act_round_f64(act, (double *)(void *)X + q * H, H);
    }
    if (f32)
        moe_expert_fast(k, w1, w3, w2, limit, act, (const float *)(void *)X, n,
                        (float *)(void *)Yo, (float *)(void *)scr);
    else
        moe_expert_ref(w1, w3, w2, limit, act, (const double *)(void *)X, n, (double *)(void *)Yo,
                       (double *)(void *)scr);
    for (int64_t q = 0; q < n; q++)
        memcpy((char *)dst + (size_t)(dst_idx ? dst_idx[q] : q) * row, Yo + (size_t)q * row, row);
    free(buf);
    return MOE_OK;
}
