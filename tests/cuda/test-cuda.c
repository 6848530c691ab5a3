/*
 * The GPU block against the CPU float64 reference (moe_block_run, MOE_PREC_REF)
 * with the same activation rounding, on the fixtures and on V4-Flash-shaped
 * synthetic layers in every weight format, through both expert paths (GEMV
 * for small T, grouped tensor cores for large T). Exits 77 (skipped) when no
 * CUDA device is present. MOE_TEST_CUDA_QUICK=1 leaves out the V4-Flash-shaped
 * layers (the compute-sanitizer run); MOE_TEST_CUDA_ONLY=units runs only the
 * kernels' self-tests (racecheck).
 *
 * Tolerances, on ||gpu - ref|| / ||ref|| over the tokens whose expert set
 * agrees (routing is compared separately):
 *  TOL_SAME_OPERANDS = 2e-4 (GEMV path): both sides feed the GEMMs the same bf16-rounded
 *    activations and exactly the same weight values; the GPU accumulates in
 *    fp32 (dot error ~ sqrt(H) * 6e-8 = 4e-6 for H = 4096) and its SwiGLU
 *    output differs by that much before its bf16 rounding, which then flips
 *    for a fraction ~ 4e-6 / 2^-9 = 2e-3 of the elements by one bf16 ulp
 *    (2^-8 relative): sqrt(2e-3) * 2^-8 = 1.7e-4 in norm at worst; observed
 *    3.4e-5 on the H200.
 *  TOL_MMA = 1e-3 (tensor-core path): as above, but Hopper's mma accumulates
 *    fp32 with truncation of the aligned addends, not round-to-nearest, so
 *    the dot error grows like n * 2^-24 (4096 * 6e-8 = 2.4e-4 worst) instead
 *    of sqrt(n) * 2^-24, and the bf16 rounding of the SwiGLU output flips
 *    correspondingly more often; observed 2.9e-4 on the H200 (BF16 weights,
 *    whose 8-bit products fill the accumulator's low bits; FP4 weights 4e-5).
 *    The wgmma GEMMs (paths wgmma, wgmma-bf16, wgmma-pd and wgmma-cp) are the same
 *    computation on the Hopper warpgroup MMA (same truncating fp32
 *    accumulation, k16 steps): the same bound; the three differ only in how
 *    the tiles reach shared memory (TMA or cp.async) and which warpgroup
 *    decodes the weights into it, and must agree bit for bit (FP8 weights
 *    with FP8 activations: wgmma runs the FP8 tensor-core GEMMs, and
 *    wgmma-pd / wgmma-cp must match wgmma-bf16 instead).
 *    The FP4 GEMVs (paths gemv and grouped on MXFP4 / NVFP4 weights: mma per
 *    scale block, src/cuda/cuda_gemv_tc.cu) accumulate each block of 16 or 32
 *    products in the tensor core and the blocks in fp32 FMAs: the same bound.
 *  TOL_FP8_F32_TILE = 5e-3: FP8 weights with fp32 tile scales reach the
 *    tensor cores as bf16(e4m3 * scale), one rounding of relative size up to
 *    2^-9 (rms 1.1e-3) per weight; the output error has the same rms.
 *  TOL_FP8_QGMMA = 1e-2: FP8 weights with FP8 activations on the FP8
 *    tensor cores (path wgmma, src/cuda/cuda_qgmma.cu). The operands are
 *    exact (the checkpoint's codes, the reference's activation codes); the
 *    error is the FP8 wgmma's reduced-precision accumulation of each
 *    128-column block (the DeepSeek-V3 report says ~14 bits; the self-test,
 *    moe_cuda_qg_selftest, measured on random codes a worst error of
 *    2^-10.1 of sum |a w| per output on the H200); the per-block fp32
 *    promotion adds 2^-24 per block. A GEMM output then moves by delta ~
 *    1e-4 .. 1e-3 relative, its SwiGLU output crosses an E4M3 rounding
 *    boundary of h for a fraction ~ 2 delta / 2^-3 of the elements, each
 *    moving by one E4M3 ulp (2^-3 relative): sqrt(1.6e-3 .. 1.6e-2) * 2^-3
 *    = 5e-3 .. 1.6e-2 in norm at the extremes; measured on the H200 3.6e-3
 *    - 3.9e-3 on the routed output (V4-Flash-shaped FP8 layers, skewed
 *    experts, H 1088 / I 320), against 4e-5 for the bf16-operand kernel on
 *    the same layers (whose operands are exact there too and whose
 *    accumulator is fp32): the price of the FP8 tensor cores' accumulator.
 *  TOL_FP8_F32_ACT = 2e-2: FP8 activations with fp32 scales (fp8-f32scale)
 *    on the bf16-operand kernels (GEMV, mma, wgmma-bf16/-pd/-cp, and the
 *    shared expert on every path): code x scale is rounded to bf16 (2^-9
 *    relative, rms 1.1e-3 per value), and h's E4M3 rounding then flips for
 *    a fraction ~ 2 x 1.1e-3 / 2^-3 = 1.8e-2 of the elements:
 *    sqrt(1.8e-2) * 2^-3 = 1.7e-2; measured 1.2e-2 (V4-Flash-shaped FP8).
 *  TOL_FP8_ACT = 3e-3: FP8 activations; a value whose fp32 and float64
 *    SwiGLU outputs straddle an E4M3 rounding boundary moves by one E4M3 ulp
 *    (2^-3 relative), for a fraction ~ 2 * 4e-6 / 2^-3 of elements:
 *    sqrt(6e-5) * 2^-3 = 1e-3.
 *  TOL_WEIGHTS = 1e-5: emitted routing weights from fp32 scores (a few fp32
 *    roundings of 6e-8 each) against float64, plus what the fp32 logits'
 *    own error dl carries: every score function has |d ln score / d l| <= 1
 *    (sigmoid, sqrtsoftplus; softmax 2 through its normalization) and the
 *    renormalization over the chosen experts doubles that, so a weight
 *    moves by at most 4 max |dl| relative (the largest dl over the token's
 *    logits, measured in the same run). The logits are held to
 *    TOL_LOGIT_FACTOR x H x 2^-24 x sum |x_h g_eh| (+ the same again for x's
 *    rounding to fp32): the worst case of the GPU's sequential fp32 dot.
 *    (Tokens whose chosen experts have tiny scores, as on the skewed hash
 *    layer, see dl matter: 1.0e-5 observed there.)
 *  MAX_FLIP_FRACTION = 0.05: tokens whose expert set differs from float64
 *    routing (fp32 logits near a tie); each must be a near tie
 *    (TOL_TIE = 1e-4 on the biased score gap).
 */
#include "harness.h"
#include "core/core.h"
#include "moeaudit_cuda.h"
#include "moeaudit_variant.h"
#include "moe_formats.h"
#include "cuda/cuda_selftest.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TOL_SAME_OPERANDS 2e-4
#define TOL_MMA 1e-3
#define TOL_FP8_F32_TILE_FP8_ACT 2e-2
#define TOL_FP8_F32_TILE 5e-3
#define TOL_FP8_ACT 3e-3
#define TOL_FP8_QGMMA 1e-2
#define TOL_FP8_F32_ACT 2e-2
#define TOL_WEIGHTS 1e-5
#define TOL_LOGIT_FACTOR 2.0
#define MAX_FLIP_FRACTION 0.05
#define TOL_TIE 1e-4

static uint64_t rng_state = 12345;
static double gauss(void) { return moe_splitmix64_gauss4(&rng_state); }

static double worst_rel = 0;
/* the worst relative error of the routed output of the MXFP4 x FP8 runs
 * on the FP8 tensor cores (transcoded MXFP4, path wgmma; the shared
 * expert's output there comes from the bf16-operand kernels), held to
 * TOL_FP8_QGMMA with the other outputs */
static double worst_mxq = 0;

/* is the set of the first K ids of a and b equal? */
static bool same_set(const int32_t *a, const int32_t *b, int K) {
    for (int i = 0; i < K; i++) {
        bool f = false;
        for (int j = 0; j < K; j++) f |= a[i] == b[j];
        if (!f) return false;
    }
    return true;
}

/* x [T, H]: the inputs (logit bound); gabs [E, H]: |router weights|.
 * Returns the routed output's relative error. */
static double compare(const char *what, const moe_layer *L, const moe_block_out *ref, const moe_block_out *gpu,
                      double tol, const double *x, const double *gabs) {
    int K = L->cfg.top_k, C = ref->n_cols, H = ref->H, E = ref->E;
    int64_t T = ref->T, flips = 0;
    double num[3] = {0}, den[3] = {0}, wmax = 0, wlim = 0, lmax = 0;
    bool finite = true, logits_ok = true, weights_ok = true;
    for (int64_t t = 0; t < T; t++) {
        double dl = 0;
        for (int e = 0; e < E; e++) {
            double d = fabs(gpu->router_logits[t * E + e] - ref->router_logits[t * E + e]), sxg = 0;
            for (int h = 0; h < H; h++) sxg += fabs(x[t * H + h]) * gabs[(size_t)e * H + h];
            double bound = TOL_LOGIT_FACTOR * 2.0 * H * 0x1p-24 * sxg;
            if (!(d <= bound)) logits_ok = false;
            dl = fmax(dl, d);
            lmax = fmax(lmax, d);
        }
        if (!same_set(ref->topk_ids + t * C, gpu->topk_ids + t * C, K)) {
            flips++;
            continue;
        }
        double wtol = TOL_WEIGHTS + 4.0 * dl;
        for (int j = 0; j < C; j++) {
            /* weights by id (order within near ties may differ) */
            int32_t id = ref->topk_ids[t * C + j];
            for (int q = 0; q < C; q++)
                if (gpu->topk_ids[t * C + q] == id) {
                    double a = gpu->topk_weights[t * C + q], b = ref->topk_weights[t * C + j];
                    double r = fabs(a - b) / fmax(fabs(b), 1e-30);
                    if (!(r <= wtol)) weights_ok = false;
                    if (r > wmax) {
                        wmax = r;
                        wlim = wtol;
                    }
                }
        }
        const double *g[3] = {gpu->moe_out + t * H, gpu->routed_out + t * H, gpu->shared_out + t * H};
        const double *r[3] = {ref->moe_out + t * H, ref->routed_out + t * H, ref->shared_out + t * H};
        for (int k = 0; k < 3; k++)
            for (int h = 0; h < H; h++) {
                double d = g[k][h] - r[k][h];
                finite = finite && isfinite(g[k][h]);
                num[k] += d * d;
                den[k] += r[k][h] * r[k][h];
            }
    }
    double rel[3];
    for (int k = 0; k < 3; k++) rel[k] = den[k] > 0 ? sqrt(num[k] / den[k]) : sqrt(num[k]);
    fprintf(stderr, "  %-46s rel moe %.2e routed %.2e shared %.2e  weights %.1e  logits %.1e  flips %lld/%lld\n",
            what, rel[0], rel[1], rel[2], wmax, lmax, (long long)flips, (long long)T);
    CHECK(finite, "%s: non-finite output", what);
    CHECK((double)flips <= MAX_FLIP_FRACTION * (double)T + 0.5, "%s: %lld of %lld tokens route differently", what,
          (long long)flips, (long long)T);
    for (int k = 0; k < 3; k++) CHECK(rel[k] <= tol, "%s: output %d relative error %.3e > %.1e", what, k, rel[k], tol);
    CHECK(logits_ok, "%s: router logits differ by up to %.3e, more than the fp32 dot's bound", what, lmax);
    CHECK(weights_ok, "%s: routing weights differ by %.3e (bound %.3e)", what, wmax, wlim);
    worst_rel = fmax(worst_rel, rel[0]);
    (void)TOL_TIE;
    return rel[1];
}

static void poison(moe_block_out *o) {
    size_t n = (size_t)(o->T * o->H);
    for (size_t i = 0; i < n; i++) o->moe_out[i] = o->routed_out[i] = o->shared_out[i] = NAN;
    for (size_t i = 0; i < (size_t)(o->T * o->n_cols); i++) o->topk_ids[i] = -1;
}

static bool is_fp4(const moe_weight *w) { return w->fmt == MOE_WFMT_MXFP4 || w->fmt == MOE_WFMT_NVFP4; }

/* Run CPU reference and GPU (every path: GEMV, tensor cores, and for FP4
 * weights the fp32 GEMV too) on T random tokens and compare. */
static void check_layer(const char *name, const moe_layer *L, int64_t T, moe_act_prec act, moe_scale_owner owner,
                        bool fuse, double tol) {
    moe_error err;
    int H = L->cfg.hidden;
    double *x = malloc(sizeof(double) * (size_t)(T * H));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)T);
    for (int64_t i = 0; i < T * H; i++) x[i] = gauss();
    for (int64_t t = 0; t < T; t++) ids[t] = L->cfg.vocab > 0 ? (int64_t)((uint64_t)(gauss() * 1e6 + 1e7) % (uint64_t)L->cfg.vocab) : 0;
    moe_run_opts o = moe_run_opts_default();
    o.act = act;
    o.owner = owner;
    o.fuse_shared = fuse;
    moe_block_out ref, gpu;
    moe_status st = moe_block_out_init(&ref, L, T, &o, &err);
    CHECK_OK(st, err);
    st = moe_block_run(L, x, ids, T, &o, &ref, &err);
    CHECK_OK(st, err);
    double *gabs = malloc(sizeof(double) * (size_t)L->cfg.n_experts * (size_t)H);
    for (int e = 0; e < L->cfg.n_experts; e++) {
        moe_weight_row_f64(&L->gate, e, gabs + (size_t)e * H);
        for (int h = 0; h < H; h++) gabs[(size_t)e * H + h] = fabs(gabs[(size_t)e * H + h]);
    }
    moe_cuda_layer *g = NULL;
    st = moe_cuda_layer_upload(L, &g, &err);
    CHECK_OK(st, err);
    bool fp4 = is_fp4(&L->w1[0]);
    if (st == MOE_OK) {
        /* the bf16-operand wgmma kernel's output (path wgmma, or wgmma-bf16
         * where wgmma runs the FP8 x FP8 GEMMs): wgmma-cp and wgmma-pd must
         * give the same bits */
        double *wg_tma_out = NULL;
        const bool fp8a = act == MOE_ACT_FP8 || act == MOE_ACT_FP8_F32SCALE;
        /* MXFP4 weights with FP8 activations: on the FP8 tensor cores when
         * the upload transcoded them (moe_cuda_layer_note says which; a
         * layer neither transcoded nor refused with a note fails) */
        moe_cuda_layer_set_path(g, MOE_CUDA_PATH_WGMMA);
        const char *ops = moe_cuda_layer_operands(g, T, act), *note = moe_cuda_layer_note(g);
        const bool mxq = L->w1[0].fmt == MOE_WFMT_MXFP4 && fp8a && !strcmp(ops, "fp8 (mxfp4 transcoded)");
        if (L->w1[0].fmt == MOE_WFMT_MXFP4 && fp8a)
            CHECK(mxq || (note && strstr(note, "stays on the bf16-operand kernels")),
                  "%s: MXFP4 with fp8 activations on path wgmma runs %s operands, note %s", name, ops,
                  note ? note : "(none)");
        const bool qg = (L->w1[0].fmt == MOE_WFMT_FP8_BLOCK && fp8a) || mxq;
        static const int order[] = {1, 2, 3, 4, 5, 8, 6, 7};
        for (int pi = 0; pi < 8; pi++) {
            const int path = order[pi];
            if ((path == 3 || path == 4) && !fp4) continue; /* GEMV_F32 and GROUPED are GEMV for these weights */
            moe_cuda_layer_set_path(g, (moe_cuda_path)path);
            st = moe_block_out_init(&gpu, L, T, &o, &err);
            CHECK_OK(st, err);
            poison(&gpu);
            o.check_invariants = true;
            st = moe_cuda_block_run(g, x, ids, T, &o, &gpu, &err);
            o.check_invariants = false;
            CHECK_OK(st, err);
            char what[160];
            const char *pn = path == 1   ? (fp4 ? "gemv-tc" : "gemv")
                             : path == 2 ? "mma"
                             : path == 3 ? "gemv-f32"
                             : path == 4 ? "grouped"
                             : path == 5 ? "wgmma"
                             : path == 6 ? "wgmma-cp"
                             : path == 7 ? "wgmma-pd"
                                         : "wgmma-bf16";
            snprintf(what, sizeof what, "%s %s act=%s owner=%s%s", name, pn,
                     moe_act_prec_name(act), moe_scale_owner_name(owner), fuse ? " fused" : "");
            double t2 = tol;
            if ((path == 2 || path >= 4 || (path == 1 && fp4)) && t2 < TOL_MMA) t2 = TOL_MMA;
            if ((path == 2 || path >= 5) && tol == TOL_FP8_F32_TILE && act != MOE_ACT_BF16)
                t2 = TOL_FP8_F32_TILE_FP8_ACT;
            if (path == 5 && qg && t2 < TOL_FP8_QGMMA) t2 = TOL_FP8_QGMMA;
            if (act == MOE_ACT_FP8_F32SCALE && t2 < TOL_FP8_F32_ACT) t2 = TOL_FP8_F32_ACT;
            if (st == MOE_OK) {
                const double r = compare(what, L, &ref, &gpu, t2, x, gabs);
                if (path == 5 && mxq) worst_mxq = fmax(worst_mxq, r);
            }
            /* the bf16-operand wgmma GEMMs' 256-token tile and their
             * 128-token tile (each forced; the default takes 256 from 128
             * positions per expert) give the same bits, routed and shared,
             * every weight format */
            if (st == MOE_OK && path == 5 && !qg) {
                /* the default follows the documented rule: 256 from 128
                 * positions per expert on average */
                const int want = T * L->cfg.top_k >= 128 * (int64_t)L->cfg.n_experts ? 256 : 128;
                CHECK(moe_cuda_layer_wg_tokens_at(g, T, act) == want, "%s: default wgmma tile %d tokens, want %d",
                      what, moe_cuda_layer_wg_tokens_at(g, T, act), want);
            }
            for (int v = 0; st == MOE_OK && path == 5 && !qg && v < 2; v++) {
                moe_block_out other;
                moe_block_out_init(&other, L, T, &o, &err);
                moe_cuda_layer_set_wg_tokens(g, v ? 256 : 128);
                /* the forced tile is the one that runs (else this compares a kernel with itself) */
                CHECK(moe_cuda_layer_wg_tokens_at(g, T, act) == (v ? 256 : 128), "%s: forced %d-token tile not taken",
                      what, v ? 256 : 128);
                moe_status st2 = moe_cuda_block_run(g, x, ids, T, &o, &other, &err);
                moe_cuda_layer_set_wg_tokens(g, 0);
                CHECK_OK(st2, err);
                if (st2 == MOE_OK)
                    CHECK(!memcmp(other.moe_out, gpu.moe_out, sizeof(double) * (size_t)(T * H)),
                          "%s: %d-token wgmma tiles differ from the default bit for bit", what, v ? 256 : 128);
                moe_block_out_free(&other);
            }
            /* the wgmma kernel's load paths (TMA, cp.async) and decoders
             * (consumer, producer warpgroup) feed the tensor cores the same
             * operands in the same order */
            if (st == MOE_OK && ((path == 5 && !qg) || (path == 8 && qg))) {
                wg_tma_out = malloc(sizeof(double) * (size_t)(T * H));
                if (wg_tma_out) memcpy(wg_tma_out, gpu.moe_out, sizeof(double) * (size_t)(T * H));
            } else if (st == MOE_OK && path >= 6 && wg_tma_out) {
                CHECK(!memcmp(wg_tma_out, gpu.moe_out, sizeof(double) * (size_t)(T * H)),
                      "%s: differs from the bf16-operand wgmma kernel (TMA loads, consumer decode) bit for bit", what);
            }
            /* determinism: a second run is bit-identical */
            moe_block_out again;
            moe_block_out_init(&again, L, T, &o, &err);
            st = moe_cuda_block_run(g, x, ids, T, &o, &again, &err);
            CHECK_OK(st, err);
            CHECK(!memcmp(again.moe_out, gpu.moe_out, sizeof(double) * (size_t)(T * H)), "%s: not deterministic", what);
            /* the small-T chain's launch changes no bit: the earlier plain
             * launches, and the programmatic ones with the GEMVs' L2
             * prefetch, give the default's (pdl) output */
            for (int v = 0; (path == 1 || path == 3 || path == 4) && v < 2; v++) {
                moe_block_out other;
                moe_block_out_init(&other, L, T, &o, &err);
                moe_cuda_layer_set_smallt_launch(g, v == 0 ? 0u : MOE_CUDA_SMALLT_PDL | MOE_CUDA_SMALLT_L2);
                st = moe_cuda_block_run(g, x, ids, T, &o, &other, &err);
                moe_cuda_layer_set_smallt_launch(g, MOE_CUDA_SMALLT_PDL);
                CHECK_OK(st, err);
                CHECK(!memcmp(other.moe_out, gpu.moe_out, sizeof(double) * (size_t)(T * H)),
                      "%s: MOE_CUDA_SMALLT_LAUNCH=%s differs from the default (pdl) bit for bit", what,
                      v == 0 ? "plain" : "pdl-l2");
                moe_block_out_free(&other);
            }
            /* batch independence: the first half alone gives the same bits */
            if (T >= 2) {
                moe_block_out half;
                int64_t T2 = T / 2;
                moe_block_out_init(&half, L, T2, &o, &err);
                st = moe_cuda_block_run(g, x, ids, T2, &o, &half, &err);
                CHECK_OK(st, err);
                if (T2 > 0)
                    CHECK(!memcmp(half.moe_out, gpu.moe_out, sizeof(double) * (size_t)(T2 * H)),
                          "%s: a token's output depends on its batch", what);
                moe_block_out_free(&half);
            }
            moe_block_out_free(&again);
            moe_block_out_free(&gpu);
        }
        free(wg_tma_out);
    }
    moe_cuda_layer_free(g);
    moe_block_out_free(&ref);
    free(gabs);
    free(x);
    free(ids);
}

/* Layer li of m when it is a MoE layer, else NULL: a dense layer, or one
 * that does not load (a failed check). */
static const moe_layer *layer_if_routed(moe_model *m, int li) {
    moe_error err;
    moe_layer_kind kind;
    if (moe_model_layer_kind(m, li, &kind, &err) != MOE_OK || kind == MOE_LAYER_DENSE) return NULL;
    const moe_layer *L = NULL;
    moe_status st = moe_model_layer(m, li, &L, &err);
    CHECK_OK(st, err);
    return st == MOE_OK ? L : NULL;
}

static void test_fixtures(void) {
    const char *models[] = {"dsv4-tiny", "dsv3-tiny", "dsv3-tiny-fp8"};
    for (int mi = 0; mi < 3; mi++) {
        moe_error err;
        moe_model *m = NULL;
        moe_status st = moe_model_open(moe_t_data(models[mi]), &m, &err);
        CHECK_OK(st, err);
        if (st) continue;
        const moe_model_info *info = moe_model_get_info(m);
        for (int li = 0; li < info->n_layers; li++) {
            const moe_layer *L = layer_if_routed(m, li);
            if (!L) continue;
            char name[64];
            snprintf(name, sizeof name, "%s L%d", models[mi], li);
            double tol = mi == 2 ? TOL_FP8_F32_TILE : TOL_SAME_OPERANDS;
            check_layer(name, L, 37, MOE_ACT_BF16, MOE_SCALE_ROUTER, false, tol);
            check_layer(name, L, 37, MOE_ACT_BF16, MOE_SCALE_RUNNER, true, tol);
            check_layer(name, L, 37, MOE_ACT_BF16, MOE_SCALE_OUTPUT, false, tol);
            check_layer(name, L, 37, MOE_ACT_FP8, MOE_SCALE_ROUTER, true, mi == 2 ? TOL_FP8_F32_TILE : TOL_FP8_ACT);
            check_layer(name, L, 3, MOE_ACT_BF16, MOE_SCALE_RUNNER, false, tol);
        }
        moe_model_free(m);
    }
}

/* Variants (faults and what-if toggles) reach the GPU's router and contract
 * as they reach the CPU's: each variant's GPU run matches the CPU reference
 * run under the same variant (a variant ignored on either side would miss by
 * the factor s, or route differently). */
static void test_variants(void) {
    static const struct { const char *model; int layer; } ls[] = {{"dsv3-tiny", 1}, {"dsv4-tiny", 3}};
    for (int li = 0; li < 2; li++) {
        moe_error err;
        moe_model *m = NULL;
        moe_status st = moe_model_open(moe_t_data(ls[li].model), &m, &err);
        CHECK_OK(st, err);
        if (st) continue;
        const moe_layer *L = NULL;
        st = moe_model_layer(m, ls[li].layer, &L, &err);
        CHECK_OK(st, err);
        moe_cuda_layer *g = NULL;
        if (st == MOE_OK) st = moe_cuda_layer_upload(L, &g, &err);
        CHECK_OK(st, err);
        int64_t T = 29; /* the GEMV path (T <= 32): TOL_SAME_OPERANDS */
        int H = L ? L->cfg.hidden : 0;
        double *x = malloc(sizeof(double) * (size_t)(T * H) + 1);
        for (int64_t i = 0; i < T * H; i++) x[i] = gauss();
        /* |router weights| [E, H], for compare's logit bound */
        int E = L ? L->cfg.n_experts : 0;
        double *gabs = malloc(sizeof(double) * (size_t)E * (size_t)H + 1);
        for (int e = 0; e < E; e++) {
            moe_weight_row_f64(&L->gate, e, gabs + (size_t)e * H);
            for (int h = 0; h < H; h++) gabs[(size_t)e * H + h] = fabs(gabs[(size_t)e * H + h]);
        }
        for (int c = 0; c < 7 && g; c++) {
            moe_variant v = moe_variant_none();
            moe_run_opts o = moe_run_opts_default();
            o.act = MOE_ACT_BF16;
            const char *name = "";
            switch (c) {
            case 0: v.fault = MOE_FAULT_SCALE_DOUBLE; name = "fault SCALE_DOUBLE"; break;
            case 1: v.fault = MOE_FAULT_SCALE_MISSING; o.owner = MOE_SCALE_RUNNER; name = "fault SCALE_MISSING (runner)"; break;
            case 2: v.fault = MOE_FAULT_NOT_RENORMALIZED; name = "fault NOT_RENORMALIZED"; break;
            case 3: v.fault = MOE_FAULT_BIASED_WEIGHTS; name = "fault BIASED_WEIGHTS"; break;
            case 4: v.ignore_bias = true; name = "ignore_bias"; break;
            case 5: v.group_mask_zero = true; name = "group_mask_zero"; break;
            case 6: v.score_override = MOE_SCORE_SOFTMAX; v.renorm_eps = 0.0; name = "softmax scores, eps 0"; break;
            }
            moe_block_out ref, gpu;
            CHECK_OK(moe_block_out_init(&ref, L, T, &o, &err), err);
            CHECK_OK(moe_block_run_variant(L, x, NULL, T, &o, &v, &ref, &err), err);
            CHECK_OK(moe_block_out_init(&gpu, L, T, &o, &err), err);
            poison(&gpu);
            st = moe_cuda_block_run_variant(g, x, NULL, T, &o, &v, &gpu, &err);
            CHECK_OK(st, err);
            char what[160];
            snprintf(what, sizeof what, "%s L%d %s", ls[li].model, ls[li].layer, name);
            if (st == MOE_OK) compare(what, L, &ref, &gpu, TOL_SAME_OPERANDS, x, gabs);
            moe_block_out_free(&ref);
            moe_block_out_free(&gpu);
        }
        free(gabs);
        free(x);
        moe_cuda_layer_free(g);
        moe_model_free(m);
    }
}

static void test_nan_token(void) {
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(moe_t_data("dsv4-tiny"), &m, &err);
    CHECK_OK(st, err);
    if (st) return;
    const moe_layer *L = NULL;
    st = moe_model_layer(m, 3, &L, &err);
    CHECK_OK(st, err);
    moe_cuda_layer *g = NULL;
    st = moe_cuda_layer_upload(L, &g, &err);
    CHECK_OK(st, err);
    int64_t T = 9;
    int H = L->cfg.hidden;
    double *x = malloc(sizeof(double) * (size_t)(T * H));
    for (int64_t i = 0; i < T * H; i++) x[i] = gauss();
    x[4 * H + 7] = NAN;
    moe_run_opts o = moe_run_opts_default();
    for (int path = 1; path <= 8 && g; path++) {
        moe_cuda_layer_set_path(g, (moe_cuda_path)path);
        moe_block_out out;
        moe_block_out_init(&out, L, T, &o, &err);
        st = moe_cuda_block_run(g, x, NULL, T, &o, &out, &err);
        CHECK_OK(st, err);
        bool nan4 = true, fin = true;
        for (int64_t t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                if (t == 4) nan4 = nan4 && isnan(out.moe_out[t * H + h]);
                else fin = fin && isfinite(out.moe_out[t * H + h]);
            }
        CHECK(nan4, "path %d: the NaN token's outputs are not all NaN", path);
        CHECK(fin, "path %d: a NaN token leaked into other tokens", path);
        moe_block_out_free(&out);
    }
    /* bad token id on a hash layer */
    const moe_layer *L0 = NULL;
    moe_model_layer(m, 0, &L0, &err);
    moe_cuda_layer *g0 = NULL;
    if (moe_cuda_layer_upload(L0, &g0, &err) == MOE_OK) {
        int64_t ids[9] = {0, 1, 2, 3, 1 << 30, 5, 6, 7, 8};
        moe_block_out out;
        moe_block_out_init(&out, L0, T, &o, &err);
        for (int64_t i = 0; i < T * H; i++) x[i] = gauss();
        st = moe_cuda_block_run(g0, x, ids, T, &o, &out, &err);
        CHECK(st == MOE_ERR_INPUT, "out-of-vocabulary token id: status %s", moe_status_str(st));
        moe_block_out_free(&out);
    }
    moe_cuda_layer_free(g0);
    moe_cuda_layer_free(g);
    free(x);
    moe_model_free(m);
}

static void test_v4flash(void) {
    moe_error err;
    moe_synth_opts so = moe_synth_opts_v4flash(16);
    for (int layer = 0; layer <= 1; layer++) {
        moe_layer *L = NULL;
        moe_status st = moe_synth_layer(&so, layer, &L, &err);
        CHECK_OK(st, err);
        if (st) continue;
        const moe_qfmt q[] = {MOE_Q_NONE, MOE_Q_MXFP4, MOE_Q_NVFP4, MOE_Q_FP8};
        for (int qi = 0; qi < 4; qi++) {
            if (layer == 0 && qi != 1) continue; /* the hash layer once, in MXFP4 */
            moe_layer *Q = NULL;
            if (q[qi] != MOE_Q_NONE) {
                moe_quant_opts qo = {q[qi], MOE_Q_NONE, 0, 0};
                st = moe_layer_quantize(L, &qo, &Q, &err);
                CHECK_OK(st, err);
                if (st) continue;
            }
            const moe_layer *U = Q ? Q : L;
            char name[64];
            snprintf(name, sizeof name, "v4flash-E16 L%d %s", layer, q[qi] == MOE_Q_NONE ? "bf16" : moe_qfmt_name(q[qi]));
            check_layer(name, U, 40, MOE_ACT_BF16, MOE_SCALE_ROUTER, false, TOL_SAME_OPERANDS);
            /* T = 1 at this shape: the FP4 GEMV chain as the bench times
             * it (K steps of 128 columns, the prefetch window at its full
             * depth; the plain launch compared bit for bit) */
            if (layer == 1 && (qi == 1 || qi == 2))
                check_layer(name, U, 1, MOE_ACT_BF16, MOE_SCALE_ROUTER, false, TOL_SAME_OPERANDS);
            /* MXFP4 with FP8 activations: path wgmma on the FP8 tensor
             * cores (transcoded at upload), both scale kinds */
            if (qi == 1) {
                check_layer(name, U, 40, MOE_ACT_FP8, MOE_SCALE_RUNNER, true, TOL_FP8_ACT);
                check_layer(name, U, 40, MOE_ACT_FP8_F32SCALE, MOE_SCALE_ROUTER, false, TOL_FP8_ACT);
            }
            /* FP8 x FP8 on the FP8 tensor cores (path wgmma), both scale kinds */
            if (qi == 3) {
                check_layer(name, U, 40, MOE_ACT_FP8, MOE_SCALE_ROUTER, false, TOL_FP8_ACT);
                check_layer(name, U, 40, MOE_ACT_FP8_F32SCALE, MOE_SCALE_RUNNER, true, TOL_FP8_ACT);
            }
            moe_layer_free(Q);
        }
        moe_layer_free(L);
    }
}

/* Skewed and empty experts on the V4-Flash hash layer: a tid2eid table that
 * sends 85% of the vocabulary to experts 0..5 (each then gets more than one
 * 128-row tile, the last one partial) and never uses experts 12..15, so
 * the grouped GEMMs see full, partial and missing tiles in one batch. */
static void test_skewed(void) {
    moe_error err;
    moe_synth_opts so = moe_synth_opts_v4flash(16);
    moe_layer *L = NULL;
    moe_status st = moe_synth_layer(&so, 0, &L, &err);
    CHECK_OK(st, err);
    if (st) return;
    int K = L->cfg.top_k, V = L->cfg.vocab;
    int32_t *t2e = malloc(sizeof(int32_t) * (size_t)V * (size_t)K);
    uint64_t r = 777;
    for (int v = 0; v < V; v++) {
        bool hot = moe_splitmix64(&r) % 100 < 85;
        for (int j = 0; j < K; j++) {
            int e;
            bool dup;
            do {
                e = hot ? j : (int)(moe_splitmix64(&r) % 12);
                dup = false;
                for (int q = 0; q < j; q++) dup |= t2e[(size_t)v * K + q] == e;
            } while (dup);
            t2e[(size_t)v * K + j] = e;
        }
    }
    const int32_t *own = L->tid2eid; /* the layer frees its own table */
    L->tid2eid = t2e;
    const moe_qfmt q[] = {MOE_Q_NONE, MOE_Q_MXFP4, MOE_Q_FP8};
    for (int qi = 0; qi < 3; qi++) {
        moe_layer *Q = NULL;
        if (q[qi] != MOE_Q_NONE) {
            moe_quant_opts qo = {q[qi], MOE_Q_NONE, 0, 0};
            st = moe_layer_quantize(L, &qo, &Q, &err);
            CHECK_OK(st, err);
            if (st) continue;
        }
        char name[64];
        snprintf(name, sizeof name, "skewed v4flash-E16 %s", q[qi] == MOE_Q_NONE ? "bf16" : moe_qfmt_name(q[qi]));
        if (q[qi] == MOE_Q_FP8 || q[qi] == MOE_Q_MXFP4) /* FP8 x FP8 (path wgmma; MXFP4 transcoded): full, partial and empty tiles */
            check_layer(name, Q, 160, MOE_ACT_FP8, MOE_SCALE_RUNNER, false, TOL_FP8_ACT);
        if (q[qi] != MOE_Q_FP8)
            check_layer(name, Q ? Q : L, 160, MOE_ACT_BF16, MOE_SCALE_RUNNER, false, TOL_SAME_OPERANDS);
        moe_layer_free(Q);
    }
    L->tid2eid = own;
    moe_layer_free(L);
    free(t2e);
}

/* Widths that are multiples of 64 but not of 128: the FP4 GEMV's last K step
 * is half full (H 1088 = 17 x 64, I 320 = 5 x 64), in both FP4 formats; in
 * FP8 the FP8 x FP8 GEMMs' last k block of 128 is half full in gate/up and
 * down, and h's last activation block has 64 values. */
static void test_odd_widths(void) {
    moe_error err;
    moe_synth_opts so = moe_synth_opts_default();
    so.hidden = 1088;
    so.inter = 320;
    so.n_experts = 8;
    so.top_k = 3;
    moe_layer *L = NULL;
    moe_status st = moe_synth_layer(&so, 1, &L, &err);
    CHECK_OK(st, err);
    if (st) return;
    /* BF16 at T = 700 (262 positions per expert on average): the default
     * takes the 256-token wgmma tile, experts over 256 positions get a
     * second, partial one (compared with the 128-token tile in check_layer) */
    check_layer("H1088-I320 bf16", L, 700, MOE_ACT_BF16, MOE_SCALE_RUNNER, false, TOL_SAME_OPERANDS);
    const moe_qfmt q[] = {MOE_Q_MXFP4, MOE_Q_NVFP4, MOE_Q_FP8};
    for (int qi = 0; qi < 3; qi++) {
        moe_layer *Q = NULL;
        moe_quant_opts qo = {q[qi], MOE_Q_NONE, 0, 0};
        st = moe_layer_quantize(L, &qo, &Q, &err);
        CHECK_OK(st, err);
        if (st) continue;
        char name[64];
        snprintf(name, sizeof name, "H1088-I320 %s", moe_qfmt_name(q[qi]));
        check_layer(name, Q, 11, MOE_ACT_BF16, MOE_SCALE_RUNNER, false, TOL_SAME_OPERANDS);
        check_layer(name, Q, 5, MOE_ACT_FP8, MOE_SCALE_ROUTER, true, TOL_FP8_ACT);
        /* T * K = 2100 assignments: the sort over two blocks of 2048 (the
         * second of 52), the tensor-core path and its combine */
        check_layer(name, Q, 700, MOE_ACT_BF16, MOE_SCALE_RUNNER, false, TOL_SAME_OPERANDS);
        if (q[qi] == MOE_Q_FP8) check_layer(name, Q, 700, MOE_ACT_FP8, MOE_SCALE_ROUTER, false, TOL_FP8_ACT);
        moe_layer_free(Q);
    }
    moe_layer_free(L);
}

/* Checkpoint layouts the loader takes besides the ones above, on the GPU
 * (src/cuda/cuda_pack.c):
 *  - compressed-tensors NVFP4 (weight_global_scale G; the float64 decoder
 *    divides e2m1 * ue4m3 by G, the GPU multiplies its fp32 sums by
 *    scale2 = fp32(1 / G), as the loader sets it): the NVFP4 layer of
 *    moe_layer_quantize with each routed expert's ModelOpt scale2 turned
 *    into G = fp32(1 / scale2), the value such a checkpoint stores. The
 *    reference then divides by G where it multiplied by scale2: within one
 *    fp32 rounding of the ModelOpt values, far inside TOL_SAME_OPERANDS.
 *  - FP8 with 32 x 32 blocks (V4.1): the GPU decoders take 128 x 128 only,
 *    so the upload must refuse, naming the tensor, and allocate nothing.
 * The layers here are shallow copies of the quantized one with their own
 * expert arrays; the weights' bytes are the quantized layer's. */
static void test_layouts(void) {
    moe_error err;
    moe_synth_opts so = moe_synth_opts_default();
    moe_layer *L = NULL;
    moe_status st = moe_synth_layer(&so, 1, &L, &err);
    CHECK_OK(st, err);
    if (st) return;
    int E = L->cfg.n_experts;
    moe_weight *w = malloc(sizeof(moe_weight) * (size_t)E * 3);
    for (int qi = 0; qi < 2 && w; qi++) {
        moe_quant_opts qo = {qi == 0 ? MOE_Q_NVFP4 : MOE_Q_FP8, MOE_Q_NONE, 0, 0};
        moe_layer *Q = NULL;
        st = moe_layer_quantize(L, &qo, &Q, &err);
        CHECK_OK(st, err);
        if (st) continue;
        moe_layer C = *Q;
        for (int e = 0; e < E; e++) {
            w[e] = Q->w1[e];
            w[E + e] = Q->w3[e];
            w[2 * E + e] = Q->w2[e];
        }
        C.w1 = w;
        C.w3 = w + E;
        C.w2 = w + 2 * E;
        if (qi == 0) {
            for (int i = 0; i < 3 * E; i++) {
                CHECK(w[i].fmt == MOE_WFMT_NVFP4 && w[i].global_scale == 0, "expert weight %d is not ModelOpt NVFP4", i);
                w[i].global_scale = (double)(float)(1.0 / (double)w[i].scale2);
                w[i].scale2 = (float)(1.0 / w[i].global_scale);
            }
            check_layer("compressed-tensors nvfp4", &C, 23, MOE_ACT_BF16, MOE_SCALE_RUNNER, false, TOL_SAME_OPERANDS);
        } else {
            w[E + 1].block_rows = w[E + 1].block_cols = 32; /* the second expert's up projection */
            w[E + 1].name = "layers.1.ffn.experts.1.w3.weight";
            moe_cuda_layer *g = NULL;
            memset(&err, 0, sizeof err);
            st = moe_cuda_layer_upload(&C, &g, &err);
            CHECK(st == MOE_ERR_UNSUPPORTED && g == NULL, "FP8 32 x 32 blocks: upload gave %s, layer %p",
                  moe_status_str(st), (void *)g);
            CHECK(strstr(err.msg, "layers.1.ffn.experts.1.w3.weight") && strstr(err.msg, "32 x 32"),
                  "FP8 32 x 32 blocks: the error does not name the tensor and its blocks: %s", err.msg);
            moe_cuda_layer_free(g);
        }
        moe_layer_free(Q);
    }
    free(w);
    moe_layer_free(L);
}

/* An MXFP4 weight as FP8_BLOCK data, built here on the host from
 * moe_formats.h's definitions (moe_mx_tile_exponent per 128 x 128 tile of
 * nonzero blocks, moe_e2m1_to_e4m3_pow2 per value; E8M0 tile scales R):
 * the same values. Returns false (and fails) when a tile does not fit.
 * data [rows, cols] and scale [ceil(rows / 128), ceil(cols / 128)] are
 * malloc'ed into *out. */
static bool mx_twin(const moe_weight *w, moe_weight *out) {
    const int64_t R = w->rows, C = w->cols, gr = (R + 127) / 128, gc = (C + 127) / 128, sb = C / 32;
    const uint8_t *pk = w->data, *es = w->scale;
    uint8_t *q = malloc((size_t)(R * C)), *sc = malloc((size_t)(gr * gc));
    bool ok = q && sc;
    for (int64_t tr = 0; ok && tr < gr; tr++)
        for (int64_t tc = 0; ok && tc < gc; tc++) {
            int lo = 255, hi = -1;
            bool nan = false;
            for (int64_t r = tr * 128; r < R && r < tr * 128 + 128; r++)
                for (int64_t b = tc * 4; b < sb && b < tc * 4 + 4; b++) {
                    bool nz = false;
                    for (int k = 0; k < 16; k++) nz |= (pk[r * (C / 2) + b * 16 + k] & 0x77) != 0;
                    const int e = es[r * sb + b];
                    nan |= e == 0xFF;
                    if (nz && e < lo) lo = e;
                    if (nz && e > hi) hi = e;
                }
            const int X = nan ? -1 : moe_mx_tile_exponent(lo, hi);
            CHECK(X >= 0, "%s: tile (%lld, %lld) does not fit E4M3 (codes %d .. %d)", w->name ? w->name : "?",
                  (long long)tr, (long long)tc, lo, hi);
            if (X < 0) {
                ok = false;
                break;
            }
            sc[tr * gc + tc] = (uint8_t)X;
            for (int64_t r = tr * 128; r < R && r < tr * 128 + 128; r++)
                for (int64_t c = tc * 128; c < C && c < tc * 128 + 128; c++) {
                    int d = es[r * sb + c / 32] - X;
                    d = d < MOE_MX_E4M3_DMIN ? MOE_MX_E4M3_DMIN : d > MOE_MX_E4M3_DMAX ? MOE_MX_E4M3_DMAX : d;
                    const uint8_t nib = (uint8_t)(c % 2 ? pk[r * (C / 2) + c / 2] >> 4 : pk[r * (C / 2) + c / 2] & 15);
                    q[r * C + c] = moe_e2m1_to_e4m3_pow2(nib, d);
                }
        }
    *out = *w;
    out->fmt = MOE_WFMT_FP8_BLOCK;
    out->data = q;
    out->scale = sc;
    out->scale_dtype = MOE_DTYPE_F8_E8M0;
    out->scale_rows = gr;
    out->scale_cols = gc;
    out->block_rows = out->block_cols = 128;
    out->scheme = "fp8 128x128 e8m0 (the MXFP4 weight's twin)";
    if (!ok) {
        free(q);
        free(sc);
        out->data = out->scale = NULL;
    }
    return ok;
}

/* MXFP4 x FP8 on the FP8 tensor cores multiplies exactly the checkpoint's
 * values: the transcoded layer (path wgmma) gives bit for bit the output
 * of the FP8_BLOCK layer built from the same values on the host (mx_twin),
 * at widths with a half k block in gate/up and down (H 1088, I 320), both
 * activation scale kinds, T = 40 (and the twin matches the CPU reference
 * too). Then a layer one of whose tiles spans 15 binades (expert 1's w2,
 * one nonzero block's scale lowered by 15) is not transcoded: the note
 * names the tensor, the operands stay bf16, and the bf16-operand path
 * matches the reference with that weight. */
static void test_mx_as_fp8(void) {
    moe_error err;
    moe_synth_opts so = moe_synth_opts_default();
    so.hidden = 1088;
    so.inter = 320;
    so.n_experts = 8;
    so.top_k = 3;
    moe_layer *L = NULL, *Q = NULL;
    moe_status st = moe_synth_layer(&so, 1, &L, &err);
    CHECK_OK(st, err);
    if (st) return;
    moe_quant_opts qo = {MOE_Q_MXFP4, MOE_Q_NONE, 0, 0};
    st = moe_layer_quantize(L, &qo, &Q, &err);
    CHECK_OK(st, err);
    if (st) {
        moe_layer_free(L);
        return;
    }
    const int E = Q->cfg.n_experts, H = Q->cfg.hidden;
    moe_weight *fw = calloc((size_t)E * 3, sizeof *fw);
    bool ok = fw != NULL;
    for (int i = 0; ok && i < 3 * E; i++)
        ok = mx_twin(i < E ? &Q->w1[i] : i < 2 * E ? &Q->w3[i - E] : &Q->w2[i - 2 * E], &fw[i]);
    moe_layer F = *Q;
    F.w1 = fw;
    F.w3 = fw + E;
    F.w2 = fw + 2 * E;
    moe_cuda_layer *gq = NULL, *gf = NULL;
    if (ok) {
        st = moe_cuda_layer_upload(Q, &gq, &err);
        CHECK_OK(st, err);
        st = moe_cuda_layer_upload(&F, &gf, &err);
        CHECK_OK(st, err);
    }
    if (gq && gf) {
        moe_cuda_layer_set_path(gq, MOE_CUDA_PATH_WGMMA);
        moe_cuda_layer_set_path(gf, MOE_CUDA_PATH_WGMMA);
        const int64_t T = 40;
        double *x = malloc(sizeof(double) * (size_t)(T * H));
        int64_t *ids = calloc((size_t)T, sizeof(int64_t));
        for (int64_t i = 0; x && i < T * H; i++) x[i] = gauss();
        const moe_act_prec acts[2] = {MOE_ACT_FP8, MOE_ACT_FP8_F32SCALE};
        for (int a = 0; x && ids && a < 2; a++) {
            moe_run_opts o = moe_run_opts_default();
            o.act = acts[a];
            const char *oq = moe_cuda_layer_operands(gq, T, o.act), *of = moe_cuda_layer_operands(gf, T, o.act);
            CHECK(!strcmp(oq, "fp8 (mxfp4 transcoded)") && !strcmp(of, "fp8"), "operands %s / %s", oq, of);
            moe_block_out bq, bf, ref;
            moe_block_out_init(&bq, Q, T, &o, &err);
            moe_block_out_init(&bf, &F, T, &o, &err);
            moe_block_out_init(&ref, &F, T, &o, &err);
            st = moe_cuda_block_run(gq, x, ids, T, &o, &bq, &err);
            CHECK_OK(st, err);
            st = moe_cuda_block_run(gf, x, ids, T, &o, &bf, &err);
            CHECK_OK(st, err);
            st = moe_block_run(&F, x, ids, T, &o, &ref, &err);
            CHECK_OK(st, err);
            const size_t nb = sizeof(double) * (size_t)(T * H);
            CHECK(!memcmp(bq.moe_out, bf.moe_out, nb) && !memcmp(bq.routed_out, bf.routed_out, nb),
                  "act %s: transcoded MXFP4 differs from its FP8_BLOCK twin", moe_act_prec_name(o.act));
            double num = 0, den = 0;
            for (int64_t i = 0; i < T * H; i++) {
                num += (bf.routed_out[i] - ref.routed_out[i]) * (bf.routed_out[i] - ref.routed_out[i]);
                den += ref.routed_out[i] * ref.routed_out[i];
            }
            const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
            fprintf(stderr, "  mxfp4 = its fp8 twin, act %s: bit-identical; twin vs reference rel %.2e\n",
                    moe_act_prec_name(o.act), rel);
            CHECK(rel <= TOL_FP8_QGMMA, "the FP8 twin against the reference: %.3e", rel);
            moe_block_out_free(&bq);
            moe_block_out_free(&bf);
            moe_block_out_free(&ref);
        }
        free(x);
        free(ids);
    }
    moe_cuda_layer_free(gq);
    moe_cuda_layer_free(gf);
    for (int i = 0; fw && i < 3 * E; i++) {
        free((void *)fw[i].data);
        free((void *)fw[i].scale);
    }
    /* a tile that does not fit */
    moe_weight *nw = malloc(sizeof(moe_weight) * (size_t)E * 3);
    const moe_weight *w2 = &Q->w2[1];
    const int64_t sb = w2->cols / 32, nsc = w2->rows * sb;
    uint8_t *s2 = malloc((size_t)nsc);
    if (nw && s2) {
        for (int e = 0; e < E; e++) {
            nw[e] = Q->w1[e];
            nw[E + e] = Q->w3[e];
            nw[2 * E + e] = Q->w2[e];
        }
        memcpy(s2, w2->scale, (size_t)nsc);
        /* the tile (0, 0): the largest code of its nonzero blocks, and one
         * nonzero block of row 5 lowered to 15 below it */
        const uint8_t *pk = w2->data;
        int hi = -1;
        for (int64_t r = 0; r < 128 && r < w2->rows; r++)
            for (int b = 0; b < 4 && b < sb; b++) {
                bool nz = false;
                for (int k = 0; k < 16; k++) nz |= (pk[r * (w2->cols / 2) + b * 16 + k] & 0x77) != 0;
                if (nz && s2[r * sb + b] > hi) hi = s2[r * sb + b];
            }
        int victim = -1;
        for (int b = 0; b < 4 && victim < 0; b++) {
            bool nz = false;
            for (int k = 0; k < 16; k++) nz |= (pk[5 * (w2->cols / 2) + b * 16 + k] & 0x77) != 0;
            if (nz) victim = b;
        }
        CHECK(hi >= 15 && victim >= 0, "expert 1 w2: no block to widen (hi %d)", hi);
        if (victim >= 0 && hi >= 15) s2[5 * sb + victim] = (uint8_t)(hi - 15);
        nw[2 * E + 1].scale = s2;
        moe_layer N = *Q;
        N.w1 = nw;
        N.w3 = nw + E;
        N.w2 = nw + 2 * E;
        moe_cuda_layer *gn = NULL;
        st = moe_cuda_layer_upload(&N, &gn, &err);
        CHECK_OK(st, err);
        if (gn) {
            const char *note = moe_cuda_layer_note(gn);
            moe_cuda_layer_set_path(gn, MOE_CUDA_PATH_WGMMA);
            const char *ops = moe_cuda_layer_operands(gn, 40, MOE_ACT_FP8);
            fprintf(stderr, "  a tile of 15 binades: %s\n", note ? note : "(no note)");
            CHECK(note && strstr(note, "stays on the bf16-operand kernels") &&
                      (!w2->name || strstr(note, w2->name)),
                  "the refusal does not say so or name %s: %s", w2->name ? w2->name : "w2", note ? note : "(none)");
            CHECK(!strcmp(ops, "bf16"), "a layer with a tile that does not fit runs %s operands", ops);
            moe_cuda_layer_free(gn);
            check_layer("mxfp4 with a tile of 15 binades", &N, 11, MOE_ACT_FP8, MOE_SCALE_RUNNER, false, TOL_FP8_ACT);
        }
    }
    free(s2);
    free(nw);
    free(fw);
    /* MOE_CUDA_MXQ=0: no twins, a note that says so, the bf16-operand
     * kernels for FP8 activations, within their tolerance */
    setenv("MOE_CUDA_MXQ", "0", 1);
    moe_cuda_layer *g0 = NULL;
    st = moe_cuda_layer_upload(Q, &g0, &err);
    CHECK_OK(st, err);
    if (g0) {
        const char *note = moe_cuda_layer_note(g0);
        moe_cuda_layer_set_path(g0, MOE_CUDA_PATH_WGMMA);
        const char *ops = moe_cuda_layer_operands(g0, 40, MOE_ACT_FP8);
        fprintf(stderr, "  MOE_CUDA_MXQ=0: %s; operands %s\n", note ? note : "(no note)", ops);
        CHECK(note && strstr(note, "MOE_CUDA_MXQ=0"), "MOE_CUDA_MXQ=0 not in the note: %s", note ? note : "(none)");
        CHECK(!strcmp(ops, "bf16"), "MOE_CUDA_MXQ=0: FP8 activations on %s operands", ops);
        moe_cuda_layer_free(g0);
        check_layer("mxfp4, MOE_CUDA_MXQ=0", Q, 11, MOE_ACT_FP8, MOE_SCALE_RUNNER, false, TOL_FP8_ACT);
    }
    unsetenv("MOE_CUDA_MXQ");
    moe_layer_free(Q);
    moe_layer_free(L);
}

/* The V4-Flash release layout's MXFP4 experts (tests/data/dsv4-flash-layout:
 * E2M1 I8 + E8M0 .scale as released; its tiles' codes span 1 - 2 binades)
 * with FP8 activations: transcoded at upload, path wgmma on the FP8 tensor
 * cores against the reference, every MoE layer (hash, top-k, the MTP
 * block's). */
static void test_v4_layout_fp8(void) {
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(moe_t_data("dsv4-flash-layout"), &m, &err);
    CHECK_OK(st, err);
    if (st) return;
    const moe_model_info *info = moe_model_get_info(m);
    for (int li = 0; li < info->n_layers + info->n_mtp; li++) {
        const moe_layer *L = layer_if_routed(m, li);
        if (!L) continue;
        char name[64];
        snprintf(name, sizeof name, "dsv4-flash-layout L%d", li);
        CHECK(L->w1[0].fmt == MOE_WFMT_MXFP4, "%s: routed experts are not MXFP4", name);
        moe_cuda_layer *g = NULL;
        st = moe_cuda_layer_upload(L, &g, &err);
        CHECK_OK(st, err);
        if (g) {
            const char *note = moe_cuda_layer_note(g);
            CHECK(note && strstr(note, "transcoded"), "%s: the MXFP4 experts were not transcoded: %s", name,
                  note ? note : "(no note)");
        }
        moe_cuda_layer_free(g);
        check_layer(name, L, 37, MOE_ACT_FP8, MOE_SCALE_ROUTER, true, TOL_FP8_ACT);
    }
    moe_model_free(m);
}

/* The wgmma path's building blocks on exact data, before the layers: a
 * failure names the decoder or operand layout that is wrong
 * (src/cuda/cuda_selftest.h). */
static void test_wgmma_units(void) {
    char msg[4096];
    int fails = moe_cuda_wg_selftest(msg, sizeof msg);
    fputs(msg, stderr);
    CHECK(fails == 0, "wgmma self-test: %d checks failed", fails);
    fails = moe_cuda_qg_selftest(msg, sizeof msg);
    fputs(msg, stderr);
    CHECK(fails == 0, "FP8 x FP8 wgmma self-test: %d checks failed", fails);
    fails = moe_cuda_ng_selftest(msg, sizeof msg);
    fputs(msg, stderr);
    CHECK(fails == 0, "sort / combine self-test: %d checks failed", fails);
    fails = moe_cuda_swiglu_selftest(msg, sizeof msg);
    fputs(msg, stderr);
    CHECK(fails == 0, "SwiGLU self-test: %d checks failed", fails);
}

/* An MXFP4 layer of V4-Flash size on a device filled to leave no room for
 * its E4M3 twins: the upload goes on without them (src/cuda/cuda_selftest.h).
 * Not in the quick run (the sanitizers' set): it fills the device. */
static void test_mxq_no_room(void) {
    char msg[1024];
    int fails = moe_cuda_mxq_room_selftest(msg, sizeof msg);
    fputs(msg, stderr);
    CHECK(fails == 0, "MXFP4 upload without room for the twins: %d checks failed", fails);
}

int main(void) {
    if (moe_cuda_device_count() == 0) {
        printf("test-cuda: no CUDA device: skipped\n");
        return 77;
    }
    char info[256];
    moe_error err;
    if (moe_cuda_device_info(info, sizeof info, &err) == MOE_OK) fprintf(stderr, "device: %s\n", info);
    RUN(test_wgmma_units);
    const char *only = getenv("MOE_TEST_CUDA_ONLY"); /* "units": the self-tests alone (racecheck) */
    if (only && !strcmp(only, "units")) return moe_t_finish();
    RUN(test_fixtures);
    RUN(test_variants);
    RUN(test_nan_token);
    RUN(test_odd_widths); /* in the quick run too: memcheck over the FP4 GEMV */
    RUN(test_layouts);
    RUN(test_mx_as_fp8); /* in the quick run too: memcheck over the transcode */
    RUN(test_v4_layout_fp8);
    const char *quick = getenv("MOE_TEST_CUDA_QUICK");
    if (!quick || strcmp(quick, "1")) {
        RUN(test_v4flash);
        RUN(test_skewed);
        RUN(test_mxq_no_room);
    }
    fprintf(stderr, "worst relative error of moe_out: %.3e\n", worst_rel);
    fprintf(stderr, "worst relative error of the routed output, transcoded MXFP4 x FP8 on the FP8 tensor cores (path wgmma): %.3e\n",
            worst_mxq);
    return moe_t_finish();
}
