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
 *  3. moe_experts_rows_f32 runs many experts in one moe_experts_fast call
 *     (work split by (expert, row range) of balanced cost over all
 *     threads); each row's output is the bits moe_expert_rows gives it (the
 *     driver's invariant).
 */
#include "experts/experts.h"
#include "core/core.h"
#include "experts/experts_fast.h"
#include "formats/act.h"

#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* A 64-byte aligned block of `bytes` (0: a minimal one); free() releases it. */
static void *alloc64(size_t bytes) {
    size_t b = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, b ? b : 64);
}

/* The fast experts over jobs on table k, with their scratch. */
static moe_status run_fast(const moe_cpu_kernels *k, double limit, moe_act_prec act, const moe_expert_job *jobs,
                           int njobs, moe_error *err) {
    int nth = moe_experts_fast_threads();
    void *scr = alloc64(moe_experts_fast_scratch(k, act, jobs, njobs, nth));
    if (!scr) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for the experts' scratch");
    moe_experts_fast(k, limit, act, jobs, njobs, scr, nth);
    free(scr);
    return MOE_OK;
}

moe_status moe_expert_rows(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit, bool f32,
                           moe_act_prec act, const moe_cpu_kernels *k, int H, int64_t n, const void *src,
                           const int64_t *src_idx, void *dst, const int64_t *dst_idx, moe_error *err) {
    if (n == 0) return MOE_OK;
    MOE_ASSERT(!f32 || k);
    int64_t I = w1->rows;
    size_t xs = (size_t)n * (size_t)H, ss = f32 ? 0 : moe_expert_scratch(H, I, n);
    size_t es = f32 ? sizeof(float) : sizeof(double), row = (size_t)H * es;
    char *buf = moe_malloc(2 * xs + ss, es);
    if (!buf) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for expert %s (%lld rows)", w1->name, (long long)n);
    char *X = buf, *Yo = buf + xs * es, *scr = Yo + xs * es;
    float in_scale = moe_act_static_scale(act, w1, w3); /* NVFP4: GEMM1's static input scale */
    for (int64_t q = 0; q < n; q++) {
        memcpy(X + (size_t)q * row, (const char *)src + (size_t)(src_idx ? src_idx[q] : q) * row, row);
        if (f32) moe_act_round_scaled_f32(act, in_scale, (float *)(void *)X + q * H, H);
        else moe_act_round_scaled_f64(act, in_scale, (double *)(void *)X + q * H, H);
    }
    moe_status st = MOE_OK;
    if (f32) {
        moe_expert_job job = {w1, w3, w2, (const float *)(void *)X, (float *)(void *)Yo, n};
        st = run_fast(k, limit, act, &job, 1, err);
    } else {
        moe_expert_ref(w1, w3, w2, limit, act, (const double *)(void *)X, n, (double *)(void *)Yo,
                       (double *)(void *)scr);
    }
    if (st == MOE_OK)
        for (int64_t q = 0; q < n; q++)
            memcpy((char *)dst + (size_t)(dst_idx ? dst_idx[q] : q) * row, Yo + (size_t)q * row, row);
    free(buf);
    return st;
}

moe_status moe_experts_rows_f32(const moe_rows_job *jobs, int njobs, double limit, moe_act_prec act,
                                const moe_cpu_kernels *k, int H, const float *src, moe_error *err) {
    MOE_ASSERT(k && (njobs == 0 || jobs));
    int64_t total = 0;
    for (int e = 0; e < njobs; e++) total += jobs[e].n;
    if (total == 0) return MOE_OK;
    size_t row = (size_t)H * sizeof(float);
    float *Xa = moe_malloc((size_t)total * (size_t)H, sizeof(float));
    float *Ya = moe_malloc((size_t)total * (size_t)H, sizeof(float));
    moe_expert_job *fj = moe_calloc((size_t)njobs, sizeof *fj);
    int64_t *off = moe_calloc((size_t)njobs + 1, sizeof *off);
    if (!Xa || !Ya || !fj || !off) {
        free(Xa); free(Ya); free(fj); free(off);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory for the rows of %d experts (%lld rows)", njobs,
                        (long long)total);
    }
    for (int e = 0; e < njobs; e++) off[e + 1] = off[e] + jobs[e].n;
    /* the gather and the rounding, over all threads */
#pragma omp parallel for schedule(dynamic, 1)
    for (int e = 0; e < njobs; e++) {
        /* NVFP4: GEMM1's static input scale, as moe_expert_rows */
        float in_scale = moe_act_static_scale(act, jobs[e].w1, jobs[e].w3);
        for (int64_t q = 0; q < jobs[e].n; q++) {
            float *x = Xa + (size_t)(off[e] + q) * (size_t)H;
            memcpy(x, src + (size_t)(jobs[e].src_idx ? jobs[e].src_idx[q] : q) * (size_t)H, row);
            moe_act_round_scaled_f32(act, in_scale, x, H);
        }
    }
    for (int e = 0; e < njobs; e++)
        fj[e] = (moe_expert_job){jobs[e].w1, jobs[e].w3, jobs[e].w2, Xa + (size_t)off[e] * (size_t)H,
                                 Ya + (size_t)off[e] * (size_t)H, jobs[e].n};
    moe_status st = run_fast(k, limit, act, fj, njobs, err);
    if (st == MOE_OK) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int e = 0; e < njobs; e++)
            for (int64_t q = 0; q < jobs[e].n; q++)
                memcpy(jobs[e].dst + (size_t)(jobs[e].dst_idx ? jobs[e].dst_idx[q] : q) * (size_t)H,
                       Ya + (size_t)(off[e] + q) * (size_t)H, row);
    }
    free(Xa);
    free(Ya);
    free(fj);
    free(off);
    return st;
}

moe_status moe_act_check_layer(const moe_layer *L, moe_act_prec act, moe_error *err) {
    if (act != MOE_ACT_NVFP4 && act != MOE_ACT_NVFP4_EXPERT) return MOE_OK;
    for (int e = 0; e < L->cfg.n_experts; e++) {
        const moe_weight *w1 = &L->w1[e], *w3 = &L->w3[e], *w2 = &L->w2[e];
        if (w1->rows == 0) continue;
        if (moe_act_static_scale(act, w1, w3) > 0 && moe_act_static_scale(act, w2, NULL) > 0) continue;
        return moe_errf(err, MOE_ERR_MISSING,
                        "layer %d: --act %s needs the static input scales of every routed expert, and expert %d (%s) "
                        "has none: an NVFP4 checkpoint from ModelOpt carries <expert>.input_scale "
                        "(compressed-tensors: input_global_scale); moe_layer_calibrate_nvfp4 (the audit's NVFP4 rows) "
                        "calibrates them", L->index, moe_act_prec_name(act), e, w1->name ? w1->name : "?");
    }
    return MOE_OK;
}
