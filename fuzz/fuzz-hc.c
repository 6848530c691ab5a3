/*
 * libFuzzer target: the hyper-connection block input (`run --block hc_ffn
 * --input`: streams [T, hc_mult, hidden], read by moe_st_read_f64) through
 * moe_hc_forward in every precision, on the weights of the bundled V4
 * fixture's layer 3 (hc_mult 4, hidden 96; loaded once). The input is the
 * safetensors file, parsed in memory.
 *
 * Properties: a failure has a message; for a token whose streams are finite,
 * pre and post weights are finite and the reference comb matrix's entries
 * lie in [0, 1] with row and column sums within 1 of 1 (Sinkhorn after 20
 * iterations need not converge on hostile inputs; it must stay a
 * nonnegative normalized matrix).
 */
#include "fuzz.h"

#include <math.h>
#include <stdio.h>

#ifndef MOE_TEST_DATA
#error "MOE_TEST_DATA must name tests/data"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static moe_hc_weights *w;
static void *ws;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    moe_error err;
    moe_model *m = NULL;
    if (moe_model_open(MOE_TEST_DATA "/dsv4-tiny", &m, &err) != MOE_OK ||
        moe_hc_load(m, 3, MOE_HC_FFN, &w, &err) != MOE_OK) {
        fprintf(stderr, "fuzz-hc: %s\n", err.msg);
        abort();
    }
    moe_model_free(m);
    ws = malloc(moe_hc_workspace_size(&w->cfg));
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    moe_st_file *f = NULL;
    moe_error err = {{0}};
    moe_status st = moe_st_open_buffer(buf, size, "fuzz-hc", &f, &err);
    if (st != MOE_OK) {
        if (err.msg[0] == '\0') abort();
        free(buf);
        return 0;
    }
    const int n = w->cfg.n, H = w->cfg.H;
    int64_t sh[3] = {-1, n, H};
    double *x = NULL;
    st = moe_st_read_f64(f, "streams", 3, sh, &x, &err);
    if (st != MOE_OK && err.msg[0] == '\0') abort();
    if (st == MOE_OK && sh[0] <= 4) { /* bounded work per input: 4 tokens x every precision */
        int64_t T = sh[0];
        double *pre = malloc((size_t)(T * n + 1) * sizeof *pre), *post = malloc((size_t)(T * n + 1) * sizeof *post);
        double *comb = malloc((size_t)(T * n * n + 1) * sizeof *comb), *col = malloc((size_t)(T * H + 1) * sizeof *col);
        for (int p = 0; p < MOE_HC_PREC_COUNT; p++) {
            moe_hc_forward(w, (moe_hc_prec)p, x, T, pre, post, comb, col, ws);
            for (int64_t t = 0; p == MOE_HC_REF && t < T; t++) {
                bool finite = true;
                for (int i = 0; i < n * H; i++) finite = finite && isfinite(x[t * n * H + i]);
                if (!finite) continue;
                for (int j = 0; j < n; j++)
                    if (!isfinite(pre[t * n + j]) || !isfinite(post[t * n + j])) abort();
                for (int i = 0; i < n * n; i++)
                    if (!(comb[t * n * n + i] >= 0 && comb[t * n * n + i] <= 1 + 1e-12)) abort();
                double dev = moe_hc_ds_deviation(comb + t * n * n, n);
                if (!(dev <= 1.0)) {
                    fprintf(stderr, "token %lld: comb deviates %g from doubly stochastic\n", (long long)t, dev);
                    abort();
                }
            }
        }
        free(pre);
        free(post);
        free(comb);
        free(col);
    }
    free(x);
    moe_st_close(f);
    free(buf);
    return 0;
}
