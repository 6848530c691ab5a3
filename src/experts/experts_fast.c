/*
 * The fast float32 SwiGLU experts over the tokens of many experts at once.
 *
 *   phase 1, per (job e, rows [a, b) of I):
 *     G_e[:, a:b] = X_e . w1[a:b]^T,  U_e[:, a:b] = X_e . w3[a:b]^T   (k->gemm, or
 *                                      k->gemm_bf16act for bf16 activations)
 *     G_e[:, a:b] <- act_round(silu(min(G, L)) * clamp(U, -L, L))
 *   one barrier
 *   phase 2, per (job e, rows [a, b) of H):
 *     Y_e[:, a:b] = G_e . w2[a:b]^T
 *
 * Invariants:
 *  1. Never allocates: G, U and the per-thread kernel workspaces live in the
 *     caller's scratch (pointers, then [n, I] G and U per job, then one
 *     workspace per thread; moe_experts_fast_scratch sizes it).
 *  2. Every output element is computed by one kernel call whose operation
 *     sequence does not depend on the row range it got (kernel contract 2),
 *     and the activation is elementwise, so results are bit-identical for
 *     any thread count, any tiling, any grouping of jobs and any batch
 *     composition.
 *  3. The activation is moe_expert_f32's, operation for operation
 *     (g / (1 + expf(-g)) * u, NaN-propagating clamps, then moe_act_round_f32
 *     over whole 128-blocks: tiles of I start at multiples of 128).
 *  4. Work assignment is static: the tiles of a phase, in job-major order,
 *     are cut into nthreads contiguous runs of equal cost (tokens x rows), so
 *     a thread streams consecutive rows of few experts; the assignment
 *     changes which thread computes a value, never the value.
 */
#include "experts/experts_fast.h"
#include "core/core.h"
#include "formats/act.h"
#include "moe_formats.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { MOE_TILE_ALIGN = 128 /* FP8 activation blocks and every kernel's row blocks divide it */ };

int moe_experts_fast_threads(void) {
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 1;
#endif
}

static size_t align64(size_t v) { return (v + 63) & ~(size_t)63; }

static bool use_bf16(const moe_cpu_kernels *k, moe_act_prec act) { return act == MOE_ACT_BF16 && k->gemm_bf16act; }

/* Per-thread kernel workspace: the largest any call of these jobs needs. */
static size_t kernel_ws(const moe_cpu_kernels *k, moe_act_prec act, const moe_expert_job *jobs, int njobs) {
    if (!use_bf16(k, act)) return 0;
    size_t m = 0;
    for (int e = 0; e < njobs; e++) {
        if (jobs[e].n <= 0) continue;
        size_t a = k->bf16act_ws(jobs[e].w1, jobs[e].n), b = k->bf16act_ws(jobs[e].w3, jobs[e].n),
               c = k->bf16act_ws(jobs[e].w2, jobs[e].n);
        if (a > m) m = a;
        if (b > m) m = b;
        if (c > m) m = c;
    }
    return align64(m);
}

/* The scratch's first part: the G and U pointers of every job. */
static size_t pointer_bytes(int njobs) { return align64((size_t)(2 * (njobs > 0 ? njobs : 0)) * sizeof(float *)); }

size_t moe_experts_fast_scratch(const moe_cpu_kernels *k, moe_act_prec act, const moe_expert_job *jobs, int njobs,
                                int nthreads) {
    size_t s = pointer_bytes(njobs);
    for (int e = 0; e < njobs; e++)
        if (jobs[e].n > 0) s += align64((size_t)(2 * jobs[e].n * jobs[e].w1->rows) * sizeof(float));
    return s + (size_t)(nthreads < 1 ? 1 : nthreads) * kernel_ws(k, act, jobs, njobs);
}

static inline float clamp_hi_f(float g, float L) { return g > L ? L : g; }
static inline float clamp_both_f(float u, float L) { return u > L ? L : (u < -L ? -L : u); }

/* Rows [*a, *b) of `rows` for part `i` of `parts`, cut at multiples of `al`. */
static void split_rows(int64_t rows, int64_t al, int64_t i, int64_t parts, int64_t *a, int64_t *b) {
    int64_t blocks = (rows + al - 1) / al;
    int64_t lo = blocks * i / parts, hi = blocks * (i + 1) / parts;
    *a = lo * al < rows ? lo * al : rows;
    *b = hi * al < rows ? hi * al : rows;
}

/* Tiles per job for a phase whose jobs have rows[e] rows: about 4 tiles per
 * thread in all (load balance), none smaller than MOE_TILE_ALIGN rows. One
 * thread: one tile per job. */
static int64_t tiles_for(int64_t rows, int64_t total_rows, int nthreads) {
    if (nthreads <= 1 || rows <= MOE_TILE_ALIGN) return 1;
    int64_t want = (int64_t)nthreads * 4;
    int64_t tile = (total_rows + want - 1) / want;
    tile = (tile + MOE_TILE_ALIGN - 1) / MOE_TILE_ALIGN * MOE_TILE_ALIGN;
    int64_t t = (rows + tile - 1) / tile, max_t = (rows + MOE_TILE_ALIGN - 1) / MOE_TILE_ALIGN;
    return t < 1 ? 1 : t > max_t ? max_t : t;
}

typedef struct ctx {
    const moe_cpu_kernels *k;
    moe_gemm_fn gemm;        /* f32 activations */
    moe_gemm_ws_fn gemm_ws;  /* bf16 activations (NULL: gemm) */
    float L;
    moe_act_prec act;
    const moe_expert_job *jobs;
    int njobs;
    float **G, **U;          /* [njobs]: [n, I] each */
    char *ws;                /* [nthreads][ws_bytes] */
    size_t ws_bytes;
    int64_t tiles1_total, tiles2_total;
} ctx;

static void gemm_call(const ctx *c, const moe_weight *w, int64_t a, int64_t b, const float *X, int64_t ldx, int64_t n,
                      float *Y, int64_t ldy, void *ws) {
    if (c->gemm_ws) c->gemm_ws(w, a, b, X, ldx, n, Y, ldy, ws);
    else c->gemm(w, a, b, X, ldx, n, Y, ldy);
}

/* Phase 1 tile: rows [a, b) of job e's I. */
static void phase1_tile(const ctx *c, int e, int64_t a, int64_t b, void *ws) {
    const moe_expert_job *j = &c->jobs[e];
    int64_t H = j->w1->cols, I = j->w1->rows, n = j->n;
    float *G = c->G[e], *U = c->U[e];
    gemm_call(c, j->w1, a, b, j->X, H, n, G + a, I, ws);
    gemm_call(c, j->w3, a, b, j->X, H, n, U + a, I, ws);
    float L = c->L;
    for (int64_t t = 0; t < n; t++) {
        float *g = G + t * I, *u = U + t * I;
        for (int64_t i = a; i < b; i++) {
            float gv = g[i], uv = u[i];
            if (L > 0) {
                gv = clamp_hi_f(gv, L);
                uv = clamp_both_f(uv, L);
            }
            g[i] = gv / (1.0f + expf(-gv)) * uv;
        }
        /* NVFP4: GEMM2's static input scale (tiles are cut at multiples of
         * 128, so each 16-value block lies in one tile) */
        moe_act_round_scaled_f32(c->act, moe_act_static_scale(c->act, j->w2, NULL), g + a, b - a);
    }
}

/* Phase 2 tile: rows [a, b) of job e's H. */
static void phase2_tile(const ctx *c, int e, int64_t a, int64_t b, void *ws) {
    const moe_expert_job *j = &c->jobs[e];
    int64_t I = j->w1->rows, H = j->w2->rows;
    gemm_call(c, j->w2, a, b, c->G[e], I, j->n, j->Y + a, H, ws);
}

/*
 * Run the tiles of one phase that fall to thread `tid` of `nth`: the tiles,
 * in job-major order with tiles_for(...) tiles per job, are weighted by
 * n * rows; the thread takes those whose cost midpoint lies in
 * [tid, tid + 1) * total / nth.
 */
static void run_phase(const ctx *c, int phase, int tid, int nth) {
    double total = 0;
    int64_t rows_total = 0;
    for (int e = 0; e < c->njobs; e++) {
        const moe_expert_job *j = &c->jobs[e];
        if (j->n <= 0) continue;
        int64_t rows = phase == 1 ? j->w1->rows : j->w2->rows;
        rows_total += rows;
        total += (double)j->n * (double)rows;
    }
    double lo = total * tid / nth, hi = total * (tid + 1) / nth, at = 0;
    void *ws = c->ws_bytes ? c->ws + (size_t)tid * c->ws_bytes : NULL;
    for (int e = 0; e < c->njobs; e++) {
        const moe_expert_job *j = &c->jobs[e];
        if (j->n <= 0) continue;
        int64_t rows = phase == 1 ? j->w1->rows : j->w2->rows;
        int64_t nt = tiles_for(rows, rows_total, nth);
        for (int64_t i = 0; i < nt; i++) {
            int64_t a, b;
            split_rows(rows, MOE_TILE_ALIGN, i, nt, &a, &b);
            double cost = (double)j->n * (double)(b - a), mid = at + 0.5 * cost;
            at += cost;
            if (a == b || mid < lo || mid >= hi) continue;
            if (phase == 1) phase1_tile(c, e, a, b, ws);
            else phase2_tile(c, e, a, b, ws);
        }
    }
}

static void run_thread(const ctx *c, int tid, int nth) {
    run_phase(c, 1, tid, nth);
#ifdef _OPENMP
    /* only inside our own team: an orphaned barrier would bind to a caller's
     * enclosing parallel region */
    if (nth > 1) {
#pragma omp barrier
    }
#endif
    run_phase(c, 2, tid, nth);
}

void moe_experts_fast(const moe_cpu_kernels *k, double limit, moe_act_prec act, const moe_expert_job *jobs, int njobs,
                      void *scratch, int nthreads) {
    MOE_ASSERT(k && (njobs == 0 || jobs) && njobs >= 0);
    MOE_ASSERT(((uintptr_t)scratch & 63) == 0);
    if (nthreads < 1) nthreads = 1;
    /* scratch: [njobs] G and U pointers, then G_e, U_e per job, then the
     * per-thread kernel workspaces */
    float **Gv = scratch, **Uv = Gv + njobs;
    char *p = (char *)scratch + pointer_bytes(njobs);
    bool any = false;
    for (int e = 0; e < njobs; e++) {
        const moe_expert_job *j = &jobs[e];
        Gv[e] = Uv[e] = NULL;
        if (j->n <= 0) continue;
        int64_t H = j->w1->cols, I = j->w1->rows;
        MOE_ASSERT(j->w3->rows == I && j->w3->cols == H && j->w2->rows == H && j->w2->cols == I);
        Gv[e] = (float *)(void *)p;
        Uv[e] = Gv[e] + j->n * I;
        p += align64((size_t)(2 * j->n * I) * sizeof(float));
        any = true;
    }
    if (!any) return;
    ctx c;
    memset(&c, 0, sizeof c);
    c.k = k;
    c.gemm = k->gemm;
    c.gemm_ws = use_bf16(k, act) ? k->gemm_bf16act : NULL;
    c.L = (float)limit;
    c.act = act;
    c.jobs = jobs;
    c.njobs = njobs;
    c.G = Gv;
    c.U = Uv;
    c.ws = p;
    c.ws_bytes = kernel_ws(k, act, jobs, njobs);
#ifdef _OPENMP
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        run_thread(&c, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    run_thread(&c, 0, 1);
}
