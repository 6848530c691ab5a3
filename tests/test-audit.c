/*
 * The audit: each class of path lands in the grade the shared tolerance
 * table (src/audit/tolerances.h) says, contract variants are free, contract
 * breaks fail, and the reports are well formed.
 */
#include "harness.h"
#include "moeaudit_variant.h"
#include "audit/tolerances.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void tokens(int64_t T, int H, double *x, int64_t *ids) {
    for (int64_t i = 0; i < T * H; i++) x[i] = sin(0.91 * (double)i) * (i % H == 5 ? 8.0 : 1.3);
    for (int64_t t = 0; t < T; t++) ids[t] = (t * 11) % 64;
}

static const moe_audit_row *find(const moe_audit_row *rows, int n, const char *name) {
    for (int i = 0; i < n; i++) if (!strcmp(rows[i].path.name, name)) return &rows[i];
    return NULL;
}

static double db(double nmse) { return -10 * log10(nmse); }

static void test_grades_on_synthetic(void) {
    moe_synth_opts so = moe_synth_opts_default();
    so.hidden = 256;
    so.inter = 128;
    so.n_experts = 16;
    so.top_k = 4;
    moe_audit_path paths[64];
    int np = moe_audit_default_paths(paths, 64);
    CHECK(np >= 20, "default paths: %d", np);
    for (int layer = 0; layer < 2; layer++) {
        moe_error err;
        moe_layer *L = NULL;
        moe_status st = moe_synth_layer(&so, layer, &L, &err);
        CHECK_OK(st, err);
        if (st) return;
        int64_t T = 96;
        double *x = malloc((size_t)(T * so.hidden) * sizeof *x);
        int64_t ids[96];
        tokens(T, so.hidden, x, ids);
        moe_audit_row rows[64];
        CHECK_OK(moe_audit_layer(L, x, ids, T, paths, np, rows, NULL, NULL, &err), err);
        for (int i = 0; i < np; i++) {
            const moe_audit_row *r = &rows[i];
            fprintf(stderr, "  layer %d %-46s %-8s %6.1f dB flips %lld\n", layer, r->path.name,
                    r->status ? "n/a" : moe_grade_name(r->grade), db(r->nmse), (long long)r->flips);
            /* every path runs on these shapes (the ISA rows may lack AVX-512) */
            if (r->path.isa == MOE_ISA_AUTO || r->path.isa == MOE_ISA_REF) CHECK(r->status == MOE_OK, "%s: %s", r->path.name, r->note);
            if (r->status) continue;
            const char *g = r->path.group;
            if (!strcmp(g, "combined")) {
                /* errors of independent shortcuts add: a recipe is never
                 * better than its parts; checked below */
            } else if (!strcmp(g, "contract") || !strcmp(g, "isa")) {
                /* float32 arithmetic alone: ~1e-7 relative, i.e. > 100 dB; and
                 * every owner and shared mode gives the same output */
                CHECK(r->grade == MOE_GRADE_PASS && db(r->nmse) > 100, "%s: %.1f dB", r->path.name, db(r->nmse));
            } else if (r->path.act == MOE_ACT_BF16 || r->path.router != MOE_ROUTER_PATH) {
                CHECK(r->grade == MOE_GRADE_PASS, "%s must PASS: %.1f dB, %lld flips", r->path.name, db(r->nmse),
                      (long long)r->flips);
            } else if (r->path.e2m1_round == 2) {
                /* truncation is biased: at best MARGINAL (it measures FAIL) */
                CHECK(r->grade != MOE_GRADE_PASS, "%s cannot PASS: %.1f dB", r->path.name, db(r->nmse));
            } else if (r->path.weights == MOE_Q_MXFP4 || r->path.weights == MOE_Q_NVFP4 || r->path.act == MOE_ACT_NVFP4) {
                /* 1 mantissa bit, nearest rounding: the table puts FP4 in MARGINAL */
                CHECK(r->grade == MOE_GRADE_MARGINAL, "%s must be MARGINAL: %.1f dB", r->path.name, db(r->nmse));
            } else {
                /* FP8 (3 mantissa bits): PASS by the table */
                CHECK(r->grade == MOE_GRADE_PASS, "%s must PASS: %.1f dB", r->path.name, db(r->nmse));
            }
        }
        /* recipes: below each of their parts in SQNR, no better in grade */
        static const char *const recipes[][3] = {
            {"V4 recipe: mxfp4 + fp8 act + fp8 shared", "mxfp4 experts", "fp8 activations (pow2 scale)"},
            {"V3 recipe: fp8 experts + fp8 act (fp32 scale)", "fp8 experts (128x128)", "fp8 activations (fp32 scale)"},
            {"nvfp4 + fp8 act + fp8 shared", "nvfp4 experts", "fp8 activations (pow2 scale)"},
            {"NVFP4 W4A4: nvfp4 experts + shared + act (TRT-LLM)", "nvfp4 experts", "nvfp4 activations (static input scale)"}};
        for (int k = 0; k < 4; k++) {
            const moe_audit_row *c = find(rows, np, recipes[k][0]), *a = find(rows, np, recipes[k][1]),
                                *b = find(rows, np, recipes[k][2]);
            CHECK(c && a && b && c->nmse > a->nmse && c->nmse > b->nmse && c->grade >= a->grade && c->grade >= b->grade,
                  "%s vs its parts", recipes[k][0]);
        }
        /* the router runs unquantized on every expert-weight path: no flips */
        CHECK(find(rows, np, "mxfp4 experts")->flips == 0, "expert weights do not move routing");
        /* E2M1 toward-zero is biased: never better than nearest-even */
        CHECK(find(rows, np, "mxfp4 experts, e2m1 toward zero")->nmse >= find(rows, np, "mxfp4 experts")->nmse,
              "truncation costs more than RNE");
        free(x);
        moe_layer_free(L);
    }
}

/* Contract breaks FAIL: through the invariant check the audit runs on every
 * path (whatever the SQNR), and the double application through the table
 * too. */
static void test_breaks_fail(void) {
    moe_synth_opts so = moe_synth_opts_default();
    moe_error err;
    moe_layer *L = NULL;
    CHECK_OK(moe_synth_layer(&so, 1, &L, &err), err);
    if (!L) return;
    int64_t T = 32;
    double x[32 * 128];
    int64_t ids[32];
    tokens(T, 128, x, ids);
    moe_run_opts o = moe_run_opts_default();
    moe_block_out ref, bad;
    CHECK_OK(moe_block_out_init(&ref, L, T, &o, &err), err);
    CHECK_OK(moe_block_run(L, x, ids, T, &o, &ref, &err), err);
    static const moe_fault faults[] = {MOE_FAULT_SCALE_DOUBLE, MOE_FAULT_SCALE_MISSING};
    for (int f = 0; f < 2; f++) {
        moe_variant v = moe_variant_none();
        v.fault = faults[f];
        CHECK_OK(moe_block_out_init(&bad, L, T, &o, &err), err);
        CHECK_OK(moe_block_run_variant(L, x, ids, T, &o, &v, &bad, &err), err);
        double se = 0, ss = 0;
        for (int64_t i = 0; i < T * 128; i++) {
            se += (bad.moe_out[i] - ref.moe_out[i]) * (bad.moe_out[i] - ref.moe_out[i]);
            ss += ref.moe_out[i] * ref.moe_out[i];
        }
        if (faults[f] == MOE_FAULT_SCALE_DOUBLE)
            CHECK(moe_grade_of(se / ss, 0) == MOE_GRADE_FAIL, "double scale grades %s (%.1f dB)",
                  moe_grade_name(moe_grade_of(se / ss, 0)), db(se / ss));
        fprintf(stderr, "  fault %d costs %.1f dB\n", (int)faults[f], db(se / ss));
        moe_block_out_free(&bad);
        moe_run_opts chk = o;
        chk.check_invariants = true;
        CHECK_OK(moe_block_out_init(&bad, L, T, &chk, &err), err);
        CHECK(moe_block_run_variant(L, x, ids, T, &chk, &v, &bad, &err) == MOE_ERR_INVARIANT,
              "the audit's check catches fault %d",
              (int)faults[f]);
        moe_block_out_free(&bad);
    }
    moe_block_out_free(&ref);
    moe_layer_free(L);
    /* flips alone */
    CHECK(moe_grade_of(1e-9, 0.02) == MOE_GRADE_MARGINAL && moe_grade_of(1e-9, 0.2) == MOE_GRADE_FAIL, "flip grades");
    CHECK(moe_grade_of(NAN, 0) == MOE_GRADE_FAIL, "NaN output fails");
}

static void test_reports(void) {
    moe_error err;
    moe_model *m = NULL;
    CHECK_OK(moe_model_open(moe_t_data("dsv4-tiny"), &m, &err), err);
    const moe_layer *L = NULL;
    if (m) CHECK_OK(moe_model_layer(m, 3, &L, &err), err);
    if (!L) { moe_model_free(m); return; }
    moe_audit_path paths[64];
    int np = moe_audit_default_paths(paths, 64);
    int64_t T = 16;
    double x[16 * 96];
    int64_t ids[16];
    tokens(T, 96, x, ids);
    moe_audit_row rows[64];
    CHECK_OK(moe_audit_layer(L, x, ids, T, paths, np, rows, NULL, NULL, &err), err);
    /* I = 40 cannot hold FP4 blocks: those rows say so instead of failing */
    const moe_audit_row *r = find(rows, np, "mxfp4 experts");
    CHECK(r && r->status == MOE_ERR_SHAPE && strstr(r->note, "multiple of the mxfp4 block"), "mxfp4 on I = 40: %s",
          r ? r->note : "?");
    moe_audit_meta meta = {"dsv4-tiny", T, "test", 0.5};
    char path[600];
    moe_t_tmp_path(path, sizeof path, "audit.json");
    FILE *f = fopen(path, "w+");
    CHECK(f && moe_audit_report_json(f, &meta, rows, np) == MOE_OK, "json written");
    if (f) {
        rewind(f);
        static char buf[1 << 18];
        moe_t_read_into(f, buf, sizeof buf);
        fclose(f);
        cJSON *j = cJSON_Parse(buf);
        CHECK(j != NULL, "report JSON parses");
        cJSON *arr = cJSON_GetObjectItem(j, "rows");
        CHECK(cJSON_GetArraySize(arr) == np, "one row per path");
        cJSON *first = cJSON_GetArrayItem(arr, 0);
        CHECK(first && cJSON_GetObjectItem(first, "grade") && cJSON_GetObjectItem(first, "path"), "row keys");
        cJSON_Delete(j);
    }
    moe_t_tmp_path(path, sizeof path, "audit.html");
    f = fopen(path, "w+");
    CHECK(f && moe_audit_report_html(f, &meta, rows, np) == MOE_OK, "html written");
    if (f) {
        rewind(f);
        static char buf[1 << 20];
        moe_t_read_into(f, buf, sizeof buf);
        fclose(f);
        CHECK(strstr(buf, "<svg") && strstr(buf, "</html>") && !strstr(buf, "<script") && !strstr(buf, "http://www.w3.org/2000/svg\" src"),
              "self-contained HTML with SVG");
    }
    moe_model_free(m);
}

int main(void) {
    RUN(test_grades_on_synthetic);
    RUN(test_breaks_fail);
    RUN(test_reports);
    return moe_t_finish();
}
