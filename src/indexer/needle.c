/*
 * The needle probe: would the indexer keep an entry the query matches just
 * above the selection cut-off, under each key/query precision?
 * The model is described in docs/indexer.md.
 *
 * Invariants:
 *  1. The float64 needle score is constructed, not sampled: the needle key is
 *     beta * v with beta = target / I64(v) (the score is positively
 *     homogeneous in k), target = cutoff64 + margin * sigma, where cutoff64
 *     is the index_topk-th largest float64 score among the other entries and
 *     sigma the std of the float64 distractor scores. With margin > 0 the
 *     float64 selection always holds the needle.
 *  2. Distractor scores do not depend on the needle, its depth or topk: they
 *     are computed once per (length, trial, precision), and the needle only
 *     replaces entry j.
 *  3. Every random draw comes from splitmix64 seeded by (seed, length index,
 *     trial[, depth]): results are reproducible and independent of threads.
 */
#include "moeaudit_indexer.h"
#include "core/core.h"
#include "indexer/indexer_impl.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------- rng */

typedef struct rng {
    uint64_t s;
    bool has;
    double spare;
} rng;

static uint64_t rng_u64(rng *r) { return moe_splitmix64(&r->s); }

static double rng_unit(rng *r) { return ((double)(rng_u64(r) >> 11) + 0.5) * 0x1.0p-53; } /* (0, 1) */

static double rng_gauss(rng *r) {
    if (r->has) { r->has = false; return r->spare; }
    double u = rng_unit(r), v = rng_unit(r);
    double m = sqrt(-2.0 * log(u)), a = 6.283185307179586 * v;
    r->spare = m * sin(a);
    r->has = true;
    return m * cos(a);
}

static rng rng_make(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
    rng r = {seed ^ (a * 0xD1B54A32D192ED03ull) ^ (b * 0xABC98388FB8FAC03ull) ^ (c * 0x8CB92BA72F3D8DD7ull), false, 0};
    rng_u64(&r);
    return r;
}

/* ------------------------------------------------------------ helpers */

static void rope(double *x, int dim, int rd, double theta, double pos) {
    if (theta <= 0 || rd <= 0) return;
    int base = dim - rd;
    for (int i = 0; i < rd / 2; i++) {
        double f = pos * pow(theta, -2.0 * i / rd);
        double c = cos(f), s = sin(f);
        double a = x[base + 2 * i], b = x[base + 2 * i + 1];
        x[base + 2 * i] = a * c - b * s;
        x[base + 2 * i + 1] = a * s + b * c;
    }
}

static int cmp_desc(const void *pa, const void *pb) {
    double a = *(const double *)pa, b = *(const double *)pb;
    return a > b ? -1 : (a < b);
}

/* NaN -> -inf so that sorting and counting are total. */
static inline double nn(double x) { return x != x ? -INFINITY : x; }

/* k-th largest (1-based) among sorted[0..n) (descending) after removing one
 * copy of value v (present in the array). -INFINITY when fewer than k remain. */
static double kth_excluding(const double *sorted, int64_t n, double v, int k) {
    if (n - 1 < k) return -INFINITY;
    int64_t lo = 0, hi = n; /* g = number of entries > v */
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (sorted[mid] > v) lo = mid + 1; else hi = mid;
    }
    return lo <= k - 1 ? sorted[k] : sorted[k - 1];
}

/* Rank of a needle of score v at index j among scores[0..n) (entry j itself
 * replaced by the needle), ties to the lower index. */
static int64_t rank_of(const double *scores, int64_t n, int64_t j, double v) {
    v = nn(v);
    int64_t r = 1;
    for (int64_t s = 0; s < n; s++) {
        if (s == j) continue;
        double x = nn(scores[s]);
        r += x > v || (x == v && s < j);
    }
    return r;
}

static void fill_result(moe_needle_result *r, const double *scores, const double *sorted, int64_t n, int64_t j,
                        double v, int topk, double sigma) {
    r->score = v;
    r->rank = rank_of(scores, n, j, v);
    r->selected = r->rank <= topk;
    if (n <= topk) {
        r->cutoff = -INFINITY;
        r->margin = INFINITY;
    } else {
        r->cutoff = kth_excluding(sorted, n, nn(scores[j]), topk);
        r->margin = (nn(v) - r->cutoff) / sigma;
    }
}

/* Scratch of one evaluation: prepared query per precision, key buffers. */
typedef struct prep {
    int heads, dim, n_prec;
    double *qT_ref;   /* [dim, heads] */
    float *qT;        /* [n_prec, dim, heads] */
    float *wf;        /* [heads] */
    double *tmp;      /* [dim] */
    float *ftmp;      /* [dim] */
    void *scratch;    /* quant scratch */
} prep;

static void prep_free(prep *p) {
    free(p->qT_ref);
    free(p->qT);
    free(p->wf);
    free(p->tmp);
    free(p->ftmp);
    free(p->scratch);
}

static bool prep_init(prep *p, int heads, int dim, int n_prec) {
    memset(p, 0, sizeof *p);
    p->heads = heads;
    p->dim = dim;
    p->n_prec = n_prec;
    p->qT_ref = moe_malloc((size_t)heads * dim, sizeof(double));
    p->qT = moe_malloc((size_t)(n_prec > 0 ? n_prec : 1) * heads * dim, sizeof(float));
    p->wf = moe_malloc((size_t)heads, sizeof(float));
    p->tmp = moe_malloc((size_t)dim, sizeof(double));
    p->ftmp = moe_malloc((size_t)dim, sizeof(float));
    p->scratch = moe_malloc(moe_idx_quant_scratch(dim), 1);
    return p->qT_ref && p->qT && p->wf && p->tmp && p->ftmp && p->scratch;
}

static void prep_query(prep *p, const double *q, const double *w, bool hadamard, const moe_idx_opts *precs) {
    moe_idx_prep_q_ref(q, p->heads, p->dim, hadamard, p->tmp, p->qT_ref);
    for (int i = 0; i < p->n_prec; i++)
        moe_idx_prep_q(q, p->heads, p->dim, precs[i].hadamard, precs[i].q_quant, p->ftmp, p->scratch,
                       p->qT + (size_t)i * p->heads * p->dim);
    for (int h = 0; h < p->heads; h++) p->wf[h] = (float)w[h];
}

static double score_ref_key(prep *p, const double *w, const double *k, bool hadamard) {
    memcpy(p->tmp, k, (size_t)p->dim * sizeof(double));
    if (hadamard) moe_hadamard_ref(p->tmp, p->dim);
    return moe_idx_score1_ref(p->qT_ref, w, p->tmp, p->heads, p->dim);
}

static double score_prec_key(prep *p, int i, const moe_idx_opts *o, const double *k) {
    moe_idx_prep_k(k, p->dim, o->hadamard, o->k_quant, p->scratch, p->ftmp);
    return moe_idx_score1(p->qT + (size_t)i * p->heads * p->dim, p->wf, p->ftmp, p->heads, p->dim, o->accum);
}

/* All S scores of keys k [S, dim] under float64 (i < 0) or precision i. */
static void score_all(prep *p, int i, const moe_idx_opts *o, const double *w, const double *k, int64_t S,
                      bool hadamard, double *out) {
    const int d = p->dim, H = p->heads;
    const float *qT = i >= 0 ? p->qT + (size_t)i * H * d : NULL;
#pragma omp parallel
    {
        double kd[MOE_IDX_MAX_DIM];
        float kf[MOE_IDX_MAX_DIM];
        unsigned char sc[(MOE_IDX_MAX_DIM + 32) * 6];
#pragma omp for schedule(static)
        for (int64_t s = 0; s < S; s++) {
            if (i < 0) {
                memcpy(kd, k + (size_t)s * d, (size_t)d * sizeof(double));
                if (hadamard) moe_hadamard_ref(kd, d);
                out[s] = moe_idx_score1_ref(p->qT_ref, w, kd, H, d);
            } else {
                moe_idx_prep_k(k + (size_t)s * d, d, o->hadamard, o->k_quant, sc, kf);
                out[s] = (double)moe_idx_score1(qT, p->wf, kf, H, d, o->accum);
            }
        }
    }
}

static moe_status check_dims(int heads, int dim, bool hadamard, moe_error *err) {
    if (heads < 1 || heads > MOE_IDX_MAX_HEADS || dim < 1 || dim > MOE_IDX_MAX_DIM ||
        (size_t)heads * dim > MOE_IDX_MAX_DIM * 4)
        return moe_errf(err, MOE_ERR_ARG, "%d heads x %d dims: need 1..%d heads, 1..%d dims, heads * dim <= %d", heads,
                        dim, MOE_IDX_MAX_HEADS, MOE_IDX_MAX_DIM, MOE_IDX_MAX_DIM * 4);
    if (hadamard && (dim & (dim - 1)))
        return moe_errf(err, MOE_ERR_ARG, "index head dim %d is not a power of two: no Hadamard rotation", dim);
    return MOE_OK;
}

/* ---------------------------------------------------------- one query */

moe_status moe_needle_eval(int heads, int dim, int64_t S, const double *q, const double *w, const double *k,
                           int64_t j, int topk, bool hadamard, double sigma, const moe_idx_opts *precs,
                           int n_prec, moe_needle_result *res_ref, moe_needle_result *res, moe_error *err) {
    moe_status st = check_dims(heads, dim, hadamard, err);
    for (int i = 0; st == MOE_OK && i < n_prec; i++) st = check_dims(heads, dim, precs[i].hadamard, err);
    if (st != MOE_OK) return st;
    if (j < 0 || j >= S) return moe_errf(err, MOE_ERR_ARG, "needle entry %lld outside [0, %lld)", (long long)j, (long long)S);
    if (topk < 1) return moe_errf(err, MOE_ERR_ARG, "index_topk = %d must be >= 1", topk);
    if (!(sigma > 0)) sigma = 1;
    prep p;
    double *sc = moe_malloc((size_t)S + 1, sizeof(double)), *sorted = moe_malloc((size_t)S + 1, sizeof(double));
    if (!prep_init(&p, heads, dim, n_prec) || !sc || !sorted) {
        prep_free(&p);
        free(sc);
        free(sorted);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory scoring %lld entries", (long long)S);
    }
    prep_query(&p, q, w, hadamard, precs);
    for (int i = -1; i < n_prec; i++) {
        score_all(&p, i, i >= 0 ? &precs[i] : NULL, w, k, S, hadamard, sc);
        for (int64_t s = 0; s < S; s++) sorted[s] = nn(sc[s]);
        qsort(sorted, (size_t)S, sizeof(double), cmp_desc);
        fill_result(i < 0 ? res_ref : &res[i], sc, sorted, S, j, sc[j], topk, sigma);
    }
    prep_free(&p);
    free(sc);
    free(sorted);
    return MOE_OK;
}

/* -------------------------------------------------------------- sweep */

moe_needle_config moe_needle_config_default(void) {
    static const int64_t lens[] = {1024, 2048, 4096, 8192, 16384, 32768};
    static const double depths[] = {0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
    static const int topks[] = {512};
    /* moe_idx_opts_default() (fp32 accumulation, Hadamard on) with fp32, fp8
     * and fp4 keys: constant, so concurrent calls share it safely */
    static const moe_idx_opts precs[3] = {
        {MOE_IDX_Q_F32, MOE_IDX_Q_F32, MOE_IDX_ACC_F32, true},
        {MOE_IDX_Q_FP8, MOE_IDX_Q_FP8, MOE_IDX_ACC_F32, true},
        {MOE_IDX_Q_FP4, MOE_IDX_Q_FP4, MOE_IDX_ACC_F32, true},
    };
    moe_needle_config c;
    memset(&c, 0, sizeof c);
    c.heads = 64;
    c.dim = 128;
    c.ratio = 4;
    c.margin = 0.1;
    c.trials = 4;
    c.seed = 20260501;
    c.lens = lens;
    c.n_lens = (int)(sizeof lens / sizeof lens[0]);
    c.depths = depths;
    c.n_depths = (int)(sizeof depths / sizeof depths[0]);
    c.topks = topks;
    c.n_topks = 1;
    c.precs = precs;
    c.n_prec = 3;
    c.mean_scale = 0.5;
    c.outlier_scale = 8.0;
    c.n_outliers = 4;
    c.rope_theta = 160000.0;
    c.rope_dim = 64;
    return c;
}

size_t moe_needle_cell_count(const moe_needle_config *c) {
    return (size_t)c->n_lens * (size_t)c->n_depths * (size_t)c->n_topks * (size_t)(c->n_prec + 1);
}

static size_t cell_index(const moe_needle_config *c, int li, int di, int ki, int pi /* -1.. */) {
    return (((size_t)li * c->n_depths + di) * c->n_topks + ki) * (size_t)(c->n_prec + 1) + (size_t)(pi + 1);
}

/* Distractor key of entry s (or a needle base vector) into out [dim]. */
static void draw_key(rng *r, const moe_needle_config *c, const double *sig, const double *mu, double pos, double *out) {
    for (int i = 0; i < c->dim; i++) out[i] = mu[i] + sig[i] * rng_gauss(r);
    rope(out, c->dim, c->rope_dim, c->rope_theta, pos);
}

moe_status moe_needle_probe(const moe_needle_config *c, moe_needle_cell *cells, moe_error *err) {
    moe_status st = check_dims(c->heads, c->dim, true, err);
    if (st != MOE_OK) return st;
    if (c->ratio < 1 || c->trials < 1 || c->n_lens < 1 || c->n_depths < 1 || c->n_topks < 1 || c->n_prec < 0)
        return moe_errf(err, MOE_ERR_ARG, "needle sweep: ratio %d, trials %d and the length, depth and topk lists must be >= 1",
                        c->ratio, c->trials);
    if (c->rope_dim < 0 || c->rope_dim > c->dim || c->rope_dim % 2)
        return moe_errf(err, MOE_ERR_ARG, "rope dim %d must be even and <= dim %d", c->rope_dim, c->dim);
    if (c->n_outliers < 0 || c->n_outliers > c->dim)
        return moe_errf(err, MOE_ERR_ARG, "%d outlier channels exceed dim %d", c->n_outliers, c->dim);
    int64_t maxS = 0;
    for (int li = 0; li < c->n_lens; li++) {
        int64_t S = c->lens[li] / c->ratio;
        if (S < 2) return moe_errf(err, MOE_ERR_ARG, "context length %lld gives %lld entries at ratio %d; need >= 2",
                                   (long long)c->lens[li], (long long)S, c->ratio);
        if (S > maxS) maxS = S;
    }
    for (int ki = 0; ki < c->n_topks; ki++)
        if (c->topks[ki] < 1) return moe_errf(err, MOE_ERR_ARG, "index_topk %d must be >= 1", c->topks[ki]);
    for (int di = 0; di < c->n_depths; di++)
        if (!(c->depths[di] >= 0 && c->depths[di] <= 1))
            return moe_errf(err, MOE_ERR_ARG, "depth %g outside [0, 1]", c->depths[di]);
    const int H = c->heads, d = c->dim, P = c->n_prec;
    size_t nc = moe_needle_cell_count(c);
    for (int li = 0; li < c->n_lens; li++)
        for (int di = 0; di < c->n_depths; di++)
            for (int ki = 0; ki < c->n_topks; ki++)
                for (int pi = -1; pi < c->n_prec; pi++) {
                    moe_needle_cell *cell = &cells[cell_index(c, li, di, ki, pi)];
                    memset(cell, 0, sizeof *cell);
                    cell->len = c->lens[li];
                    cell->depth = c->depths[di];
                    cell->topk = c->topks[ki];
                    cell->prec = pi;
                    cell->sparse = c->lens[li] / c->ratio > c->topks[ki];
                    cell->min_margin = INFINITY;
                }

    double *keys = moe_malloc((size_t)maxS * d, sizeof(double));
    double *scores = moe_malloc((size_t)(P + 1) * maxS, sizeof(double));
    double *sorted = moe_malloc((size_t)(P + 1) * maxS, sizeof(double));
    double *q = moe_malloc((size_t)H * d, sizeof(double)), *w = moe_malloc((size_t)H, sizeof(double));
    double *sig = moe_malloc((size_t)d, sizeof(double)), *mu = moe_malloc((size_t)d, sizeof(double));
    double *v = moe_malloc((size_t)d, sizeof(double)), *g = moe_malloc((size_t)d, sizeof(double));
    double *kn = moe_malloc((size_t)d, sizeof(double));
    prep p;
    bool ok = prep_init(&p, H, d, P);
    if (!ok || !keys || !scores || !sorted || !q || !w || !sig || !mu || !v || !g || !kn) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the needle sweep (%lld entries x %d dims)", (long long)maxS, d);
        goto done;
    }
    for (int li = 0; li < c->n_lens; li++) {
        const int64_t L = c->lens[li], S = L / c->ratio;
        for (int tr = 0; tr < c->trials; tr++) {
            rng r = rng_make(c->seed, (uint64_t)li + 1, (uint64_t)tr + 1, 0);
            /* channel scales: unit, with n_outliers random channels at outlier_scale */
            for (int i = 0; i < d; i++) sig[i] = 1.0;
            for (int o = 0; o < c->n_outliers; o++) sig[rng_u64(&r) % (uint64_t)d] = c->outlier_scale;
            double nsig = 0, nmu = 0;
            for (int i = 0; i < d; i++) { nsig += sig[i] * sig[i]; mu[i] = rng_gauss(&r); nmu += mu[i] * mu[i]; }
            for (int i = 0; i < d; i++) mu[i] *= c->mean_scale * sqrt(nsig / nmu);
            /* query heads at position L - 1 and head weights */
            for (int h = 0; h < H; h++) {
                for (int i = 0; i < d; i++) q[(size_t)h * d + i] = rng_gauss(&r);
                rope(q + (size_t)h * d, d, c->rope_dim, c->rope_theta, (double)(L - 1));
                w[h] = rng_gauss(&r) / sqrt((double)H) / sqrt((double)d);
            }
            for (int64_t s = 0; s < S; s++) draw_key(&r, c, sig, mu, (double)(s * c->ratio), keys + (size_t)s * d);
            prep_query(&p, q, w, true, c->precs);
            double mean = 0, var = 0;
            for (int pi = -1; pi < P; pi++) {
                double *sc = scores + (size_t)(pi + 1) * S, *so = sorted + (size_t)(pi + 1) * S;
                score_all(&p, pi, pi >= 0 ? &c->precs[pi] : NULL, w, keys, S, true, sc);
                for (int64_t s = 0; s < S; s++) so[s] = nn(sc[s]);
                qsort(so, (size_t)S, sizeof(double), cmp_desc);
            }
            for (int64_t s = 0; s < S; s++) mean += scores[s];
            mean /= (double)S;
            for (int64_t s = 0; s < S; s++) var += (scores[s] - mean) * (scores[s] - mean);
            double sigma = sqrt(var / (double)(S - 1));
            if (!(sigma > 0)) sigma = 1;
            /* the match direction: g = sum_h w_h q_h, scaled to a typical key norm */
            double ng = 0;
            for (int i = 0; i < d; i++) {
                g[i] = 0;
                for (int h = 0; h < H; h++) g[i] += w[h] * q[(size_t)h * d + i];
                ng += g[i] * g[i];
            }
            for (int i = 0; i < d; i++) g[i] *= sqrt(nsig) / sqrt(ng > 0 ? ng : 1);
            for (int di = 0; di < c->n_depths; di++) {
                int64_t j = (int64_t)llround(c->depths[di] * (double)(S - 1));
                rng rn = rng_make(c->seed, (uint64_t)li + 1, (uint64_t)tr + 1, (uint64_t)di + 1);
                draw_key(&rn, c, sig, mu, (double)(j * c->ratio), v);
                for (int ki = 0; ki < c->n_topks; ki++) {
                    int topk = c->topks[ki];
                    double cut64 = kth_excluding(sorted, S, nn(scores[j]), topk);
                    /* not sparse: aim at the best other entry instead, so ranks stay informative */
                    double target = (S <= topk ? sorted[0] : cut64) + c->margin * sigma;
                    /* base vector with a positive float64 score of target's sign */
                    double beta = 0;
                    for (int a = 1; a <= 21 && !(beta > 0); a++) {
                        /* gamma = 0.5, -0.5, 1, -1, ... 512, -512, then 0 */
                        double gam = a == 21 ? 0 : ldexp(a % 2 ? 1.0 : -1.0, (a - 1) / 2 - 1);
                        for (int i = 0; i < d; i++) kn[i] = v[i] + gam * g[i];
                        double s0 = score_ref_key(&p, w, kn, true);
                        if (s0 != 0 && (s0 > 0) == (target > 0)) beta = target / s0;
                    }
                    if (!(beta > 0)) continue; /* cannot place this needle: the trial is not counted */
                    for (int i = 0; i < d; i++) kn[i] *= beta;
                    for (int pi = -1; pi < P; pi++) {
                        const double *sc = scores + (size_t)(pi + 1) * S, *so = sorted + (size_t)(pi + 1) * S;
                        double vn = pi < 0 ? score_ref_key(&p, w, kn, true) : score_prec_key(&p, pi, &c->precs[pi], kn);
                        moe_needle_result res;
                        fill_result(&res, sc, so, S, j, vn, topk, sigma);
                        moe_needle_cell *cell = &cells[cell_index(c, li, di, ki, pi)];
                        cell->trials++;
                        cell->recall += res.selected;
                        cell->mean_rank += (double)res.rank;
                        cell->worst_rank = fmax(cell->worst_rank, (double)res.rank);
                        cell->mean_margin += res.margin;
                        cell->min_margin = fmin(cell->min_margin, res.margin);
                    }
                }
            }
        }
    }
    for (size_t i = 0; i < nc; i++) {
        moe_needle_cell *cell = &cells[i];
        if (cell->trials) {
            cell->recall /= cell->trials;
            cell->mean_rank /= cell->trials;
            cell->mean_margin /= cell->trials;
        }
    }
done:
    prep_free(&p);
    free(keys);
    free(scores);
    free(sorted);
    free(q);
    free(w);
    free(sig);
    free(mu);
    free(v);
    free(g);
    free(kn);
    return st;
}
