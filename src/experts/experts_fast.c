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
 *  3. The activation is moe_expert_f32's, bit for bit: the table's swiglu
 *     entry (moe_cpu_swiglu: ref scalar, avx2, avx512; amx takes avx512's)
 *     gives moe_swiglu_f32's bits, g / (1 + moe_expf_f32(-g)) * u with
 *     NaN-propagating clamps, where moe_expf_f32 is the project's exp (at
 *     most MOE_EXPF_MAX_ULP ulps, the same bits on every x86-64: no libm);
 *     then moe_act_round_f32 over whole 128-blocks (the row ranges of I
 *     start at multiples of 128).
 *  4. Work assignment (except under invariant 5) is static and balanced by
 *     estimated cost: a phase's rows, in job-major order, are cut into units
 *     (128 rows of I, 64 of H) weighted by row_cost (the weight's bytes and
 *     decode, plus the tokens' arithmetic), and thread t takes the units
 *     whose cost midpoint falls in the t-th of nthreads equal shares: one
 *     contiguous run, at most one kernel call per job it touches, no thread
 *     more than one unit above an equal share. The assignment changes
 *     which thread computes a value, never the value (invariant 2).
 *  5. Claimed chunks (moe_experts_fast_claims, MOE_EXPERTS_CLAIM below):
 *     on the amx table with bf16 activations and at least 4 jobs per
 *     thread, or on any table from 4 threads, a phase is instead a list of
 *     chunks in job-major order, one whole job each except the last
 *     2 nthreads jobs, cut into pieces of whole units: 4, or with fewer than
 *     4 jobs per thread ceil(4 nthreads / jobs) (at T = 1, 6 jobs and 16
 *     threads: 11 pieces of each, 66 chunks), at most a job's units; a thread runs
 *     the chunk whose index it drew from the phase's atomic counter, then
 *     draws again. A thread whose core runs slower (the Xeon of
 *     docs/performance.md shares its cores and AMX units with something
 *     outside the guest) takes fewer chunks instead of holding the barrier, and the
 *     short last chunks leave at most a quarter job's time between the
 *     threads at the barrier. Each chunk is one kernel call per weight, so
 *     invariant 2 holds as for the static split.
 */
#include "experts/experts_fast.h"
#include "core/core.h"
#include "formats/act.h"
#include "moe_formats.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Rows per unit of work: phase 1 (rows of I) in units of 128, so that the
 * activation rounding's blocks (FP8: 128, NVFP4: 16) never straddle two
 * calls; phase 2 (rows of H, no rounding after it) in units of 64, which
 * every kernel's row blocks divide (4 rows; AMX: 2 x 16) and which keep two
 * threads' outputs off one cache line when Y's rows are 64-byte aligned. */
enum { MOE_UNIT1 = 128, MOE_UNIT2 = 64 };

/* Invariant 5's policy (moe_experts_fast_claims): 0 the static split
 * always; 1 claimed chunks on the amx table with bf16 activations only (the
 * default before 2026-12-02); 2 claimed chunks on every table; 3, the
 * default: on the amx table with bf16 activations from 2 threads, on every
 * table from MOE_CLAIM_MIN_THREADS. Measured on the H200 machine's 16-core
 * Xeon guest (docs/performance.md, "ninth session"), policy 1 against 2
 * alternated three times: at 16 threads the claimed chunks took 18-40% off
 * the f32 rows at T = 16 and 16-37% at T = 128 in every round; at 2 pinned
 * threads they were 6-14% slower in two rounds and 2-4% faster in one (the
 * static split's balance holds when each thread has a core of its own).
 * Policies 1 and 2 claim only with at least 4 jobs per thread; policy 3
 * also below that, in finer pieces: 16 threads, T = 1, 2, 4, 8 took 10-20%,
 * 13-24%, 23-28% and 23-27% less than the static split in four alternated
 * rounds (same document). bench/amx_parts builds this file again with 0
 * and 1. */
#ifndef MOE_EXPERTS_CLAIM
#define MOE_EXPERTS_CLAIM 3
#endif
enum { MOE_CLAIM_MIN_JOBS = 4, MOE_CLAIM_PIECES = 4, MOE_CLAIM_MIN_THREADS = 4 };

int moe_experts_fast_threads(void) {
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 1;
#endif
}

static size_t align64(size_t v) { return (v + 63) & ~(size_t)63; }

static bool use_bf16(const moe_cpu_kernels *k, moe_act_prec act) { return act == MOE_ACT_BF16 && k->gemm_bf16act; }
static bool is_amx(const moe_cpu_kernels *k) { return k->isa && strcmp(k->isa, "amx") == 0; }

bool moe_experts_fast_claims(const moe_cpu_kernels *k, moe_act_prec act, int active, int nthreads) {
#ifndef _OPENMP
    (void)k, (void)act, (void)active, (void)nthreads;
    return false;
#else
    if (nthreads < 2 || active < 1 || MOE_EXPERTS_CLAIM == 0) return false;
    const bool many = active >= MOE_CLAIM_MIN_JOBS * nthreads;
    const bool amx_bf16 = is_amx(k) && use_bf16(k, act);
    switch (MOE_EXPERTS_CLAIM) {
    case 1: return many && amx_bf16;
    case 2: return many;
    default: return (many && amx_bf16) || nthreads >= MOE_CLAIM_MIN_THREADS;
    }
#endif
}

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

typedef struct ctx {
    const moe_cpu_kernels *k;
    moe_gemm_fn gemm;        /* f32 activations */
    moe_gemm_ws_fn gemm_ws;  /* bf16 activations (NULL: gemm) */
    bool amx;                /* gemm_ws is the amx table's (row_cost) */
    float L;
    moe_act_prec act;
    const moe_expert_job *jobs;
    int njobs;
    float **G, **U;          /* [njobs]: [n, I] each */
    char *ws;                /* [nthreads][ws_bytes] */
    size_t ws_bytes;
    int active;              /* jobs with tokens */
    bool claim;              /* invariant 5 */
    _Atomic int64_t *next;   /* [2]: the phases' chunk counters (claim) */
} ctx;

static void gemm_call(const ctx *c, const moe_weight *w, int64_t a, int64_t b, const float *X, int64_t ldx, int64_t n,
                      float *Y, int64_t ldy, void *ws) {
    if (c->gemm_ws) c->gemm_ws(w, a, b, X, ldx, n, Y, ldy, ws);
    else c->gemm(w, a, b, X, ldx, n, Y, ldy);
}

/* Phase 1: rows [a, b) of job e's I. */
static void phase1_tile(const ctx *c, int e, int64_t a, int64_t b, void *ws) {
    const moe_expert_job *j = &c->jobs[e];
    int64_t H = j->w1->cols, I = j->w1->rows, n = j->n;
    float *G = c->G[e], *U = c->U[e];
    gemm_call(c, j->w1, a, b, j->X, H, n, G + a, I, ws);
    gemm_call(c, j->w3, a, b, j->X, H, n, U + a, I, ws);
    moe_swiglu_fn swiglu = moe_cpu_swiglu(c->k);
    for (int64_t t = 0; t < n; t++) {
        float *g = G + t * I, *u = U + t * I;
        swiglu(g + a, u + a, b - a, c->L); /* invariant 3 */
        /* NVFP4: GEMM2's static input scale (row ranges start at multiples
         * of 128, so each 16-value block lies in one range) */
        moe_act_round_scaled_f32(c->act, moe_act_static_scale(c->act, j->w2, NULL), g + a, b - a);
    }
}

/* Phase 2: rows [a, b) of job e's H. */
static void phase2_tile(const ctx *c, int e, int64_t a, int64_t b, void *ws) {
    const moe_expert_job *j = &c->jobs[e];
    int64_t I = j->w1->rows, H = j->w2->rows;
    gemm_call(c, j->w2, a, b, c->G[e], I, j->n, j->Y + a, H, ws);
}

/* Cost of one row of job j in a phase (w: that phase's weight, n tokens):
 * the weight's bytes streamed and decoded, plus the per-token arithmetic,
 * in units of about one fp32 FMA per weight (kernel-independent estimate,
 * invariant 4):
 *   cols * (8 * bytes per weight + 1 + tok * n)
 * with tok = 2 (fp32 FMAs: 2 per 32 weights per token against ~5 for the
 * MXFP4 decode and its 17 bytes on an AVX-512 core), 1 (vdpbf16ps: one per
 * 32 weights per token), 1/4 (AMX tiles: ~11x vdpbf16ps's peak on the Xeon
 * of docs/performance.md, less the packing). Only ratios matter: within a
 * phase it weighs an expert of n tokens against one of m. */
static double row_cost(const ctx *c, const moe_weight *w, int64_t n) {
    double bpw;
    switch (w->fmt) {
    case MOE_WFMT_F64: bpw = 8; break;
    case MOE_WFMT_F32: bpw = 4; break;
    case MOE_WFMT_F16:
    case MOE_WFMT_BF16: bpw = 2; break;
    case MOE_WFMT_FP8_BLOCK: bpw = 1; break;
    case MOE_WFMT_MXFP4: bpw = 0.5 + 1.0 / 32; break;
    default: bpw = 0.5 + 1.0 / 16; break; /* NVFP4 */
    }
    double tok = !c->gemm_ws ? 2.0 : c->amx ? 0.25 : 1.0;
    return (double)w->cols * (8.0 * bpw + 1.0 + tok * (double)n);
}

/* A phase's rows of job e (phase 1: I, the gate and up weights together;
 * phase 2: H, the down weight) and their cost per row. */
static int64_t phase_rows(const ctx *c, int phase, int e, double *cost) {
    const moe_expert_job *j = &c->jobs[e];
    if (phase == 1) {
        *cost = row_cost(c, j->w1, j->n) + row_cost(c, j->w3, j->n);
        return j->w1->rows;
    }
    *cost = row_cost(c, j->w2, j->n);
    return j->w2->rows;
}

/*
 * Run the rows of one phase that fall to thread `tid` of `nth`. The phase's
 * rows, job after job, are cut into units (MOE_UNIT1 / MOE_UNIT2 rows, the
 * last of a job shorter) weighted by row_cost; the thread takes the units
 * whose cost midpoint lies in [tid, tid + 1) * total / nth: one contiguous
 * run in job-major order, so at most one kernel call per job it touches,
 * and no thread more than one unit above an equal share (invariant 4).
 * Every thread computes the same `at` sums in the same order, so the
 * boundaries between threads are the same doubles: each unit goes to
 * exactly one thread.
 */
static void run_phase(const ctx *c, int phase, int tid, int nth) {
    const int64_t unit = phase == 1 ? MOE_UNIT1 : MOE_UNIT2;
    double total = 0;
    for (int e = 0; e < c->njobs; e++) {
        if (c->jobs[e].n <= 0) continue;
        double rc;
        int64_t rows = phase_rows(c, phase, e, &rc);
        total += (double)rows * rc;
    }
    double lo = total * tid / nth, hi = total * (tid + 1) / nth, at = 0;
    void *ws = c->ws_bytes ? c->ws + (size_t)tid * c->ws_bytes : NULL;
    for (int e = 0; e < c->njobs && at < hi; e++) {
        if (c->jobs[e].n <= 0) continue;
        double rc;
        int64_t rows = phase_rows(c, phase, e, &rc), a = -1, b = -1;
        for (int64_t r = 0; r < rows; r += unit) {
            int64_t re = r + unit < rows ? r + unit : rows;
            double cost = (double)(re - r) * rc, mid = at + 0.5 * cost;
            at += cost;
            if (mid < lo || mid >= hi) continue;
            if (a < 0) a = r;
            b = re;
        }
        if (a < 0) continue;
        if (phase == 1) phase1_tile(c, e, a, b, ws);
        else phase2_tile(c, e, a, b, ws);
    }
}

/*
 * Invariant 5: the chunks of one phase, drawn from c->next[phase - 1]. The
 * list (job-major; job q of the `active` ones with tokens is one chunk when
 * q < active - 2 nth, else its units cut into up to MOE_CLAIM_PIECES
 * pieces) is the same for every thread; a thread walks it once, running the
 * chunks whose indices it drew (increasing), so each chunk runs exactly
 * once, on whichever thread drew it.
 */
static void claim_phase(const ctx *c, int phase, int tid, int nth) {
    const int64_t unit = phase == 1 ? MOE_UNIT1 : MOE_UNIT2;
    _Atomic int64_t *next = &c->next[phase - 1];
    void *ws = c->ws_bytes ? c->ws + (size_t)tid * c->ws_bytes : NULL;
    /* fewer than MOE_CLAIM_MIN_JOBS jobs per thread (few tokens): every job
     * is in the tail, cut finer, so that the list still holds about that
     * many chunks per thread */
    const int64_t few = ((int64_t)MOE_CLAIM_MIN_JOBS * nth + c->active - 1) / c->active;
    const int64_t tail_pieces = few > MOE_CLAIM_PIECES ? few : MOE_CLAIM_PIECES;
    int64_t want = atomic_fetch_add_explicit(next, 1, memory_order_relaxed), idx = 0;
    for (int e = 0, q = 0; e < c->njobs; e++) {
        if (c->jobs[e].n <= 0) continue;
        double rc;
        int64_t rows = phase_rows(c, phase, e, &rc), units = (rows + unit - 1) / unit;
        int64_t pieces = q++ < c->active - 2 * nth ? 1 : units < tail_pieces ? units : tail_pieces;
        for (int64_t p = 0; p < pieces; p++, idx++) {
            if (idx != want) continue;
            int64_t a = p * units / pieces * unit, b = (p + 1) * units / pieces * unit;
            if (b > rows) b = rows;
            if (phase == 1) phase1_tile(c, e, a, b, ws);
            else phase2_tile(c, e, a, b, ws);
            want = atomic_fetch_add_explicit(next, 1, memory_order_relaxed);
        }
    }
}

static void run_thread(const ctx *c, int tid, int nth) {
    if (c->claim) {
        claim_phase(c, 1, tid, nth);
#ifdef _OPENMP
#pragma omp barrier
#endif
        claim_phase(c, 2, tid, nth);
        return;
    }
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
    int active = 0;
    for (int e = 0; e < njobs; e++) {
        const moe_expert_job *j = &jobs[e];
        Gv[e] = Uv[e] = NULL;
        if (j->n <= 0) continue;
        int64_t H = j->w1->cols, I = j->w1->rows;
        MOE_ASSERT(j->w3->rows == I && j->w3->cols == H && j->w2->rows == H && j->w2->cols == I);
        Gv[e] = (float *)(void *)p;
        Uv[e] = Gv[e] + j->n * I;
        p += align64((size_t)(2 * j->n * I) * sizeof(float));
        active++;
    }
    if (!active) return;
    ctx c;
    memset(&c, 0, sizeof c);
    c.k = k;
    c.gemm = k->gemm;
    c.gemm_ws = use_bf16(k, act) ? k->gemm_bf16act : NULL;
    c.amx = is_amx(k);
    c.L = (float)limit;
    c.act = act;
    c.jobs = jobs;
    c.njobs = njobs;
    c.G = Gv;
    c.U = Uv;
    c.ws = p;
    c.ws_bytes = kernel_ws(k, act, jobs, njobs);
    c.active = active;
    _Atomic int64_t next[2];
    atomic_init(&next[0], 0);
    atomic_init(&next[1], 0);
    c.next = next;
#ifdef _OPENMP
    /* invariant 5 (the chunks are right for a team of any size: every
     * thread walks the same list; the counters need only atomicity, the
     * barrier and the region's end order the data) */
    c.claim = moe_experts_fast_claims(k, act, active, nthreads);
    if (nthreads > 1) {
#pragma omp parallel num_threads(nthreads)
        run_thread(&c, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    run_thread(&c, 0, 1);
}
