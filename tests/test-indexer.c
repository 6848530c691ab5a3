/*
 * The lightning indexer and the needle probe.
 *
 * Tolerances:
 *  TOL_REF = 1e-12, relative to sum_h |w_h| ||q_h|| ||k|| (the largest a
 *    score can be): the float64 path rotates q and k with a normalised
 *    Hadamard transform (orthonormal, so exact scores are unchanged) and the
 *    naive reference below does not rotate; the difference is rounding of
 *    log2(d) + 1 butterfly stages and a d-term dot, ~ (log2 d + d) * 2^-53.
 *  Quantized paths: per score, the derived bound score_bound() below (no
 *    fudge factor): each rotated element y_i of q or k is off by at most
 *      e_rot + (2^-9 + r_f + 2^-9 r_f) (|y_i| + e_rot) + a_f + 4u |y_i|
 *    with u = 2^-24, e_rot = (log2 d + 2) u ||x||_1 / sqrt(d) (fp32 FWHT),
 *    2^-9 the bf16 pass, and (r_f, a_f) the format's relative / absolute
 *    error: bf16 (0, 0), fp8 (2^-4, scale 2^-10), fp4 (2^-2, scale / 4);
 *    scale <= 2 amax / 448 (fp8) or 2 amax / 6 (fp4). Dot errors follow as
 *    sum |q||dk| + |dq||k| + |dq||dk| plus fp32 accumulation gamma_d; ReLU is
 *    1-Lipschitz; the head sum adds gamma_H (bf16 accumulation: (H + 3) 2^-9).
 */
#include "harness.h"
#include "core/core.h"
#include "indexer/indexer_impl.h"
#include "moeaudit_indexer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TOL_REF 1e-12

static uint64_t st_rng = 99;
static double gauss(void) { return moe_splitmix64_gauss4(&st_rng); }

/* Independent naive scores: no rotation, plain loops, float64. */
static double naive_score(const double *q, const double *w, const double *k, int H, int d) {
    double s = 0;
    for (int h = 0; h < H; h++) {
        double dot = 0;
        for (int i = 0; i < d; i++) dot += q[h * d + i] * k[i];
        s += w[h] * (dot > 0 ? dot : 0);
    }
    return s;
}

static void test_hadamard(void) {
    for (int n = 1; n <= 64; n *= 2) {
        double x[64], y[64], z[64];
        for (int i = 0; i < n; i++) x[i] = gauss();
        memcpy(y, x, (size_t)n * sizeof x[0]);
        moe_hadamard_ref(y, n);
        /* against the matrix definition H_ij = (-1)^popcount(i & j) / sqrt(n) */
        double e = 0;
        for (int i = 0; i < n; i++) {
            double s = 0;
            for (int j = 0; j < n; j++) s += (__builtin_popcount((unsigned)(i & j)) & 1 ? -x[j] : x[j]);
            e = fmax(e, fabs(s / sqrt((double)n) - y[i]));
        }
        CHECK(e < 1e-13, "n=%d hadamard vs matrix: %.3g", n, e);
        memcpy(z, y, sizeof y);
        moe_hadamard_ref(z, n); /* an involution */
        e = 0;
        for (int i = 0; i < n; i++) e = fmax(e, fabs(z[i] - x[i]));
        CHECK(e < 1e-13, "n=%d H(H(x)) = x: %.3g", n, e);
    }
}

static void test_ref_vs_naive(void) {
    const int H = 4, d = 32;
    const int64_t T = 6, S = 40;
    double *q = malloc(sizeof(double) * T * H * d), *k = malloc(sizeof(double) * S * d), w[6 * 4];
    for (int64_t i = 0; i < T * H * d; i++) q[i] = gauss();
    for (int64_t i = 0; i < S * d; i++) k[i] = gauss() + (i % d == 3 ? 5 : 0);
    for (int i = 0; i < T * H; i++) w[i] = gauss() * 0.1;
    int64_t pos[6] = {0, 3, 7, 20, 39, 100};
    for (int ratio = 1; ratio <= 4; ratio += 3) {
        moe_idx_shape sh = {T, S, H, d, ratio};
        double *sc = malloc(sizeof(double) * T * S);
        moe_idx_scores_ref(&sh, q, k, w, pos, true, sc);
        double worst = 0;
        for (int64_t t = 0; t < T; t++) {
            int64_t nv = ratio == 1 ? (pos[t] + 1 < S ? pos[t] + 1 : S) : ((pos[t] + 1) / ratio < S ? (pos[t] + 1) / ratio : S);
            CHECK(moe_idx_visible(&sh, pos[t]) == nv, "visible(%lld) ratio %d", (long long)pos[t], ratio);
            for (int64_t s = 0; s < S; s++) {
                double v = sc[t * S + s];
                if (s >= nv) { CHECK(v == -INFINITY, "invisible entry t=%lld s=%lld scored %g", (long long)t, (long long)s, v); continue; }
                double ref = naive_score(q + t * H * d, w + t * H, k + s * d, H, d), scale = 0;
                for (int h = 0; h < H; h++) {
                    double nq = 0, nk = 0;
                    for (int i = 0; i < d; i++) { nq += q[(t * H + h) * d + i] * q[(t * H + h) * d + i]; nk += k[s * d + i] * k[s * d + i]; }
                    scale += fabs(w[t * H + h]) * sqrt(nq * nk);
                }
                worst = fmax(worst, fabs(v - ref) / scale);
            }
        }
        CHECK(worst <= TOL_REF, "ratio %d: float64 path vs naive %.3g", ratio, worst);
        /* selection against a naive full ordering */
        int topk = 5;
        int32_t *sel = malloc(sizeof(int32_t) * T * topk);
        moe_error err;
        moe_status st = moe_idx_topk(&sh, sc, pos, topk, sel, &err);
        CHECK_OK(st, err);
        for (int64_t t = 0; t < T; t++) {
            int64_t nv = moe_idx_visible(&sh, pos[t]);
            bool used[64] = {false};
            for (int j = 0; j < topk; j++) {
                int64_t best = -1;
                for (int64_t s = 0; s < nv; s++)
                    if (!used[s] && (best < 0 || sc[t * S + s] > sc[t * S + best])) best = s;
                if (best >= 0) used[best] = true;
                CHECK(sel[t * topk + j] == (int32_t)best, "t=%lld slot %d: %d vs naive %lld", (long long)t, j,
                      sel[t * topk + j], (long long)best);
            }
        }
        free(sel);
        free(sc);
    }
    free(q);
    free(k);
}

/* The scorers run keys in blocks (8 float64 / 16 float keys at a time); each
 * score must be the one-key core's bit for bit (the same operations in the
 * same order), at every block remainder, with NaN and huge inputs, every
 * rounding and both accumulations. */
static void test_blocked_equals_one_key(void) {
    const int H = 3, d = 64;
    const int64_t T = 4, S = 37; /* 37 = 4 x 8 + 5 = 2 x 16 + 5 */
    double *q = malloc(sizeof(double) * T * H * d), *k = malloc(sizeof(double) * S * d), w[4 * 3];
    for (int64_t i = 0; i < T * H * d; i++) q[i] = gauss();
    for (int64_t i = 0; i < S * d; i++) k[i] = gauss();
    k[5 * d + 7] = NAN;      /* one key poisoned: its scores NaN in every path */
    k[11 * d + 2] = 1e30;    /* one huge key: overflows to inf in fp32 */
    for (int i = 0; i < T * H; i++) w[i] = gauss();
    int64_t pos[4] = {3, 36, 100, 147}; /* ratio 4: 1, 9, 25 and all 37 entries visible */
    moe_idx_shape sh = {T, S, H, d, 4};
    double *sc = malloc(sizeof(double) * T * S);
    double qT[64 * 3], tmp[64], kr[64];
    long bad = 0;
    for (int rot = 0; rot < 2; rot++) {
        moe_idx_scores_ref(&sh, q, k, w, pos, rot, sc);
        for (int64_t t = 0; t < T; t++) {
            moe_idx_prep_q_ref(q + t * H * d, H, d, rot, tmp, qT);
            for (int64_t s = 0; s < moe_idx_visible(&sh, pos[t]); s++) {
                memcpy(kr, k + s * d, sizeof kr);
                if (rot) moe_hadamard_ref(kr, d);
                double one = moe_idx_score1_ref(qT, w + t * H, kr, H, d);
                bad += memcmp(&one, &sc[t * S + s], sizeof one) != 0;
            }
        }
    }
    CHECK(bad == 0, "float64 blocked scores differ from the one-key core in %ld scores", bad);
    static const moe_idx_quant qs[] = {MOE_IDX_Q_F32, MOE_IDX_Q_BF16, MOE_IDX_Q_FP8, MOE_IDX_Q_FP8_POW2, MOE_IDX_Q_FP4};
    void *ws = malloc(moe_idx_workspace_size(&sh));
    float *krf = malloc(sizeof(float) * S * d), qTf[64 * 3], tmpf[64], wf[3];
    void *scratch = malloc(moe_idx_quant_scratch(d));
    bad = 0;
    long compared = 0;
    for (size_t qi = 0; qi < sizeof qs / sizeof qs[0]; qi++)
        for (int acc = 0; acc < 2; acc++)
            for (int rot = 0; rot < 2; rot++) {
                moe_idx_opts o = {qs[qi], qs[qi], acc ? MOE_IDX_ACC_BF16 : MOE_IDX_ACC_F32, rot};
                moe_idx_scores(&sh, &o, q, k, w, pos, sc, ws);
                moe_idx_prep_keys(&sh, &o, k, krf, scratch);
                for (int64_t t = 0; t < T; t++) {
                    moe_idx_prep_q(q + t * H * d, H, d, rot, o.q_quant, tmpf, scratch, qTf);
                    for (int h = 0; h < H; h++) wf[h] = (float)w[t * H + h];
                    for (int64_t s = 0; s < S; s++) {
                        double one = s < moe_idx_visible(&sh, pos[t])
                                       ? (double)moe_idx_score1(qTf, wf, krf + s * d, H, d, o.accum) : -INFINITY;
                        bad += memcmp(&one, &sc[t * S + s], sizeof one) != 0;
                        compared++;
                    }
                }
            }
    CHECK(bad == 0, "engine blocked scores differ from the one-key core in %ld of %ld scores", bad, compared);
    free(scratch);
    free(krf);
    free(ws);
    free(sc);
    free(q);
    free(k);
}

static void test_ties_and_nan(void) {
    double sc[6] = {1.0, 3.0, 3.0, NAN, 2.0, 3.0};
    moe_idx_shape sh = {1, 6, 1, 1, 1};
    int64_t pos = 5;
    int32_t sel[6];
    moe_error err;
    CHECK_OK(moe_idx_topk(&sh, sc, &pos, 6, sel, &err), err);
    int32_t want[6] = {1, 2, 5, 4, 0, 3};
    for (int j = 0; j < 6; j++) CHECK(sel[j] == want[j], "slot %d: %d, want %d", j, sel[j], want[j]);
    CHECK(moe_idx_rank(sc, 6, 5) == 3 && moe_idx_rank(sc, 6, 1) == 1 && moe_idx_rank(sc, 6, 3) == 6, "ranks");
    pos = 1; /* only 2 visible: slots past them are -1 */
    CHECK_OK(moe_idx_topk(&sh, sc, &pos, 4, sel, &err), err);
    CHECK(sel[0] == 1 && sel[1] == 0 && sel[2] == -1 && sel[3] == -1, "padding %d %d %d %d", sel[0], sel[1], sel[2], sel[3]);
    CHECK(moe_idx_topk(&sh, sc, &pos, 0, sel, &err) == MOE_ERR_ARG, "topk 0 rejected");
}

/* Per-element bound on the engine's rotated, rounded vector (see header). */
static void elem_bounds(const double *x, int d, moe_idx_quant qz, double *y /*[d] exact rotated*/, double *b) {
    const double u = 0x1p-24;
    memcpy(y, x, sizeof(double) * d);
    moe_hadamard_ref(y, d);
    double l1 = 0, amax = 0;
    for (int i = 0; i < d; i++) { l1 += fabs(x[i]); amax = fmax(amax, fabs(y[i])); }
    double erot = (log2((double)d) + 2) * u * l1 / sqrt((double)d);
    double r = 0, a = 0, pre = qz == MOE_IDX_Q_F32 ? 0 : 0x1p-9;
    double am = (amax + erot) * (1 + pre);
    if (qz == MOE_IDX_Q_FP8 || qz == MOE_IDX_Q_FP8_POW2) { r = 0x1p-4; a = 2 * fmax(am, 1e-4) / 448 * 0x1p-10; }
    if (qz == MOE_IDX_Q_FP4) { r = 0.25; a = 2 * am / 6 * 0.25; }
    for (int i = 0; i < d; i++)
        b[i] = erot + (pre + r + pre * r) * (fabs(y[i]) + erot) + a + 4 * u * fabs(y[i]);
}

static double score_bound(const double *q, const double *w, const double *k, int H, int d, moe_idx_quant qz,
                          moe_idx_accum acc) {
    const double u = 0x1p-24;
    double yk[128], bk[128], yq[128], bq[128];
    elem_bounds(k, d, qz, yk, bk);
    double total = 0, sumterm = 0;
    for (int h = 0; h < H; h++) {
        elem_bounds(q + h * d, d, qz, yq, bq);
        double e = 0, mag = 0, dot = 0;
        for (int i = 0; i < d; i++) {
            e += fabs(yq[i]) * bk[i] + bq[i] * fabs(yk[i]) + bq[i] * bk[i];
            mag += (fabs(yq[i]) + bq[i]) * (fabs(yk[i]) + bk[i]);
            dot += yq[i] * yk[i];
        }
        e += d * u / (1 - d * u) * mag;
        double adot = fabs(dot) + e;
        if (acc == MOE_IDX_ACC_BF16) e += 0x1p-9 * adot * 3; /* dot, ReLU'd dot x w, term: three bf16 roundings */
        total += fabs(w[h]) * (e + u * adot);
        sumterm += fabs(w[h]) * adot;
    }
    total += (acc == MOE_IDX_ACC_BF16 ? (H + 3) * 0x1p-9 : (H + 1) * u) * sumterm;
    return total;
}

static void test_quantized_bounds(void) {
    const int H = 8, d = 128;
    const int64_t T = 3, S = 64;
    double *q = malloc(sizeof(double) * T * H * d), *k = malloc(sizeof(double) * S * d), w[3 * 8];
    for (int64_t i = 0; i < T * H * d; i++) q[i] = gauss();
    for (int64_t i = 0; i < S * d; i++) k[i] = gauss() * (i % d == 17 ? 20 : 1) + (i % 7 == 0 ? 2 : 0);
    for (int i = 0; i < T * H; i++) w[i] = gauss() / sqrt((double)H * d);
    int64_t pos[3] = {S - 1, S - 1, 10};
    moe_idx_shape sh = {T, S, H, d, 1};
    double *ref = malloc(sizeof(double) * T * S), *sc = malloc(sizeof(double) * T * S);
    void *ws = malloc(moe_idx_workspace_size(&sh));
    moe_idx_scores_ref(&sh, q, k, w, pos, true, ref);
    for (int acc = 0; acc < 2; acc++)
        for (int qz = 0; qz < MOE_IDX_Q_COUNT; qz++) {
            moe_idx_opts o = {(moe_idx_quant)qz, (moe_idx_quant)qz, (moe_idx_accum)acc, true};
            moe_idx_scores(&sh, &o, q, k, w, pos, sc, ws);
            double worst = 0, err_max = 0;
            int bad = 0;
            for (int64_t t = 0; t < T; t++)
                for (int64_t s = 0; s < moe_idx_visible(&sh, pos[t]); s++) {
                    double b = score_bound(q + t * H * d, w + t * H, k + s * d, H, d, (moe_idx_quant)qz, (moe_idx_accum)acc);
                    double e = fabs(sc[t * S + s] - ref[t * S + s]);
                    bad += !(e <= b);
                    worst = fmax(worst, e / b);
                    err_max = fmax(err_max, e);
                }
            CHECK(bad == 0, "%s acc %s: %d scores outside the derived bound (worst ratio %.3g)", moe_idx_quant_name((moe_idx_quant)qz),
                  acc ? "bf16" : "fp32", bad, worst);
            fprintf(stderr, "  %-8s acc %-4s max |err| %.3e, worst err/bound %.3f\n", moe_idx_quant_name((moe_idx_quant)qz),
                    acc ? "bf16" : "fp32", err_max, worst);
        }
    free(q);
    free(k);
    free(ref);
    free(sc);
    free(ws);
}

/* The constructed case: FP8 keys tie the needle with a distractor and the
 * lower index wins, while fp32 (and float64) keep it. No rotation, one head:
 * the score is k[0]; element 1 = 448 fixes every key's FP8 scale to exactly
 * 1.0, where E4M3 spacing in [8, 16) is 1. Distractors 12, 11, 10, 9 are
 * exact; the needle (entry 4) scores 11.4, which FP8 rounds to 11. */
static void test_needle_constructed(void) {
    const int d = 32, S = 5;
    double q[32] = {1.0}, w[1] = {1.0}, k[5 * 32];
    memset(k, 0, sizeof k);
    double s0[5] = {12, 11, 10, 9, 11.4};
    for (int s = 0; s < S; s++) { k[s * d] = s0[s]; k[s * d + 1] = 448; }
    moe_idx_opts precs[3];
    for (int i = 0; i < 3; i++) precs[i] = moe_idx_opts_default(), precs[i].hadamard = false;
    precs[1].k_quant = MOE_IDX_Q_FP8;
    precs[2].k_quant = MOE_IDX_Q_FP8_POW2;
    moe_needle_result ref, res[3];
    moe_error err;
    moe_status st = moe_needle_eval(1, d, S, q, w, k, 4, 2, false, 1.0, precs, 3, &ref, res, &err);
    CHECK_OK(st, err);
    CHECK(ref.selected && ref.rank == 2 && fabs(ref.margin - 0.4) < 1e-12 && ref.cutoff == 11,
          "float64: rank %lld margin %g cutoff %g", (long long)ref.rank, ref.margin, ref.cutoff);
    CHECK(res[0].selected && res[0].rank == 2 && fabs(res[0].margin - 0.4) < 1e-6,
          "fp32 keeps the needle: rank %lld margin %g", (long long)res[0].rank, res[0].margin);
    CHECK(!res[1].selected && res[1].rank == 3 && res[1].score == 11 && res[1].margin == 0,
          "FP8 drops it: selected %d rank %lld score %g margin %g", res[1].selected, (long long)res[1].rank, res[1].score,
          res[1].margin);
    CHECK(!res[2].selected && res[2].rank == 3, "FP8 pow2 drops it too: rank %lld", (long long)res[2].rank);
    /* with the needle first (lower index than the 11-distractor) the tie is won */
    double k2[5 * 32];
    memcpy(k2, k, sizeof k);
    memcpy(k2, k + 4 * d, sizeof(double) * d);
    memcpy(k2 + 4 * d, k, sizeof(double) * d);
    st = moe_needle_eval(1, d, S, q, w, k2, 0, 2, false, 1.0, precs, 3, &ref, res, &err);
    CHECK_OK(st, err);
    CHECK(res[1].selected && res[1].rank == 2, "FP8 tie at the lower index is kept: rank %lld", (long long)res[1].rank);
    CHECK(moe_needle_eval(1, d, S, q, w, k, 5, 2, false, 1.0, precs, 3, &ref, res, &err) == MOE_ERR_ARG, "j out of range");
    CHECK(moe_needle_eval(1, 24, S, q, w, k, 1, 2, true, 1.0, precs, 0, &ref, res, &err) == MOE_ERR_ARG,
          "Hadamard needs a power of two");
}

static void test_probe_small(void) {
    moe_needle_config c = moe_needle_config_default();
    /* the default precisions (constant, shared by every call): the default
     * options with fp32, fp8 and fp4 queries and keys */
    static const moe_idx_quant want_q[3] = {MOE_IDX_Q_F32, MOE_IDX_Q_FP8, MOE_IDX_Q_FP4};
    CHECK(c.n_prec == 3 && c.precs == moe_needle_config_default().precs, "default precisions: %d", c.n_prec);
    for (int i = 0; i < 3 && c.n_prec == 3; i++) {
        moe_idx_opts d = moe_idx_opts_default();
        CHECK(c.precs[i].q_quant == want_q[i] && c.precs[i].k_quant == want_q[i] && c.precs[i].accum == d.accum &&
                  c.precs[i].hadamard == d.hadamard,
              "default precision %d", i);
    }
    int64_t lens[3] = {128, 512, 2048};
    double depths[3] = {0, 0.5, 1};
    int topks[2] = {16, 64};
    moe_idx_opts precs[3];
    for (int i = 0; i < 3; i++) precs[i] = moe_idx_opts_default();
    precs[1].q_quant = precs[1].k_quant = MOE_IDX_Q_FP8;
    precs[2].q_quant = precs[2].k_quant = MOE_IDX_Q_FP4;
    c.heads = 8;
    c.dim = 64;
    c.rope_dim = 32;
    c.lens = lens; c.n_lens = 3;
    c.depths = depths; c.n_depths = 3;
    c.topks = topks; c.n_topks = 2;
    c.precs = precs; c.n_prec = 3;
    c.trials = 3;
    c.margin = 0.05;
    size_t n = moe_needle_cell_count(&c);
    CHECK(n == 3 * 3 * 2 * 4, "cell count %zu", n);
    moe_needle_cell *a = calloc(n, sizeof *a), *b = calloc(n, sizeof *b);
    moe_error err;
    CHECK_OK(moe_needle_probe(&c, a, &err), err);
    CHECK_OK(moe_needle_probe(&c, b, &err), err);
    CHECK(!memcmp(a, b, n * sizeof *a), "the sweep is deterministic");
    double fp4 = 0;
    int nf = 0;
    for (size_t i = 0; i < n; i++) {
        if (a[i].prec < 1) {
            CHECK(a[i].trials == 3 && a[i].recall == 1.0, "len %lld topk %d prec %d: recall %g (trials %d)",
                  (long long)a[i].len, a[i].topk, a[i].prec, a[i].recall, a[i].trials);
        }
        if (a[i].prec == -1 && a[i].sparse)
            CHECK(fabs(a[i].min_margin - 0.05) < 1e-6, "float64 margin %g", a[i].min_margin);
        if (!a[i].sparse) CHECK(a[i].recall == 1.0 && a[i].min_margin == INFINITY, "dense cells keep everything");
        CHECK(a[i].sparse == (a[i].len / 4 > a[i].topk), "sparse flag");
        if (a[i].prec == 2 && a[i].sparse) { fp4 += a[i].recall; nf++; }
    }
    CHECK(nf > 0 && fp4 / nf < 1.0, "fp4 loses some needles at margin 0.05 (mean recall %.3f)", nf ? fp4 / nf : -1);
    c.depths = (double[]){1.5};
    c.n_depths = 1;
    CHECK(moe_needle_probe(&c, a, &err) == MOE_ERR_ARG, "depth 1.5 rejected: %s", err.msg);
    free(a);
    free(b);
}

static void test_recall_and_weights(void) {
    /* real V4 weights from the fixture: layer 3 has an indexer */
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(moe_t_data("dsv4-tiny"), &m, &err);
    CHECK_OK(st, err);
    if (st) return;
    moe_idx_weights *iw = NULL;
    st = moe_idx_load(m, 3, &iw, &err);
    CHECK_OK(st, err);
    if (iw) {
        CHECK(iw->heads == 4 && iw->dim == 16 && iw->topk == 8 && iw->ratio == 4 && iw->q_lora_rank == 32 && iw->has_compressor,
              "indexer config %d %d %d %d %d", iw->heads, iw->dim, iw->topk, iw->ratio, iw->q_lora_rank);
        const int64_t T = 64, S = 16;
        double *qr = malloc(sizeof(double) * T * 32), *x = malloc(sizeof(double) * T * 96);
        double *q = malloc(sizeof(double) * T * 64), *w = malloc(sizeof(double) * T * 4), *k = malloc(sizeof(double) * S * 16);
        for (int64_t i = 0; i < T * 32; i++) qr[i] = gauss();
        for (int64_t i = 0; i < T * 96; i++) x[i] = gauss();
        for (int64_t i = 0; i < S * 16; i++) k[i] = gauss();
        moe_idx_project(iw, qr, x, T, q, w);
        double e = 0; /* spot check q[5, 2, 3] and w[7, 1] */
        double a = 0, b = 0;
        for (int i = 0; i < 32; i++) a += iw->wq_b[(2 * 16 + 3) * 32 + i] * qr[5 * 32 + i];
        for (int i = 0; i < 96; i++) b += iw->weights_proj[1 * 96 + i] * x[7 * 96 + i];
        e = fmax(fabs(a - q[5 * 64 + 2 * 16 + 3]), fabs(b / 8.0 - w[7 * 4 + 1]));
        CHECK(e < 1e-12, "projection spot check %.3g", e);
        int64_t pos[64];
        for (int t = 0; t < T; t++) pos[t] = t;
        moe_idx_shape sh = {T, S, 4, 16, 4};
        moe_idx_opts precs[3];
        for (int i = 0; i < 3; i++) precs[i] = moe_idx_opts_default();
        precs[1].q_quant = precs[1].k_quant = MOE_IDX_Q_FP8;
        precs[2].q_quant = precs[2].k_quant = MOE_IDX_Q_FP4;
        moe_idx_recall r[3];
        st = moe_idx_recall_run(&sh, q, k, w, pos, 8, precs, 3, r, &err);
        CHECK_OK(st, err);
        CHECK(r[0].mean_recall == 1.0 && r[0].queries == 64 - 35, "fp32 recall %g over %lld queries", r[0].mean_recall,
              (long long)r[0].queries);
        CHECK(r[1].mean_recall > 0.8 && r[2].mean_recall > 0.5 && r[2].mean_recall <= r[0].mean_recall,
              "fp8 %g fp4 %g", r[1].mean_recall, r[2].mean_recall);
        fprintf(stderr, "  fixture indexer, random inputs: top-8 recall fp32 %.3f fp8 %.3f fp4 %.3f\n", r[0].mean_recall,
                r[1].mean_recall, r[2].mean_recall);
        free(qr); free(x); free(q); free(w); free(k);
    }
    moe_idx_weights_free(iw);
    iw = NULL;
    st = moe_idx_load(m, 0, &iw, &err);
    CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "indexer"), "layer 0 has no indexer: %s", err.msg);
    moe_model_free(m);
    moe_idx_quant qz;
    CHECK(moe_idx_quant_parse("fp8-pow2", &qz) && qz == MOE_IDX_Q_FP8_POW2, "parse fp8-pow2");
    CHECK(!moe_idx_quant_parse("int8", &qz), "int8 is not a precision");
}

/* #1: positions at the end of int64 (needle --tensors reads them from a file):
 * (pos + 1) / ratio overflowed, the visible count went negative and qsort got
 * a huge count. */
static void test_extreme_positions(void) {
    moe_idx_shape sh = {.T = 3, .S = 5, .heads = 1, .dim = 4, .ratio = 4};
    CHECK(moe_idx_visible(&sh, INT64_MAX) == 5, "INT64_MAX sees all");
    CHECK(moe_idx_visible(&sh, INT64_MIN) == 0, "INT64_MIN sees none");
    CHECK(moe_idx_visible(&sh, 18) == 4 && moe_idx_visible(&sh, 19) == 5 && moe_idx_visible(&sh, 3) == 1 &&
              moe_idx_visible(&sh, 2) == 0, "(pos + 1) / r");
    sh.ratio = 1;
    CHECK(moe_idx_visible(&sh, INT64_MAX) == 5 && moe_idx_visible(&sh, 0) == 1, "ratio 1");
    sh.ratio = 4;
    int64_t pos[3] = {INT64_MAX, INT64_MIN, INT64_MAX - 1};
    double scores[15];
    for (int i = 0; i < 15; i++) scores[i] = (double)(i % 7);
    int32_t sel[6];
    moe_error err;
    CHECK_OK(moe_idx_topk(&sh, scores, pos, 2, sel, &err), err);
    CHECK(sel[0] == 4 && sel[1] == 3 && sel[2] == -1 && sel[3] == -1, "selection %d %d %d %d", sel[0], sel[1], sel[2],
          sel[3]);
}

int main(void) {
    RUN(test_extreme_positions);
    RUN(test_hadamard);
    RUN(test_ref_vs_naive);
    RUN(test_blocked_equals_one_key);
    RUN(test_ties_and_nan);
    RUN(test_quantized_bounds);
    RUN(test_needle_constructed);
    RUN(test_probe_small);
    RUN(test_recall_and_weights);
    return moe_t_finish();
}
