/*
 * moe_diagnose on dumps that real engines wrote (tests/data/engine-dumps/,
 * README.md there): transformers 5.17 and a torch module of transformers'
 * code, running the bundled checkpoints on an H200 in bfloat16 and float32,
 * each contract bug injected into the running engine. Every layer of every
 * dump must get the verdict of cases.tsv and the engine's noise class, with
 * all the dump's tensors, without topk_ids and router_logits (the flip search
 * and the output fit alone), and without topk_ids.
 */
#include "harness.h"

#include <stdlib.h>
#include <string.h>

typedef struct dcase {
    char file[160], model[32], dtype[8], bug[32], verdict[32], noise[16];
    int layer;
} dcase;

static int read_cases(dcase *cs, int cap) {
    char path[1024], line[512];
    snprintf(path, sizeof path, "%s/engine-dumps/cases.tsv", MOE_TEST_DATA);
    FILE *f = fopen(path, "r");
    CHECK(f != NULL, "cannot open %s", path);
    if (!f) return 0;
    int n = 0;
    while (n < cap && fgets(line, sizeof line, f)) {
        if (line[0] == '#' || line[0] == '\n') continue;
        dcase *c = &cs[n];
        if (sscanf(line, "%159s %31s %d %7s %31s %31s %15s", c->file, c->model, &c->layer, c->dtype, c->bug, c->verdict,
                   c->noise) == 7)
            n++;
        else
            CHECK(0, "bad line in cases.tsv: %s", line);
    }
    fclose(f);
    return n;
}

static void test_engine_dumps(void) {
    static dcase cs[256];
    int n = read_cases(cs, 256);
    CHECK(n >= 70, "cases.tsv lists %d layer cases", n);
    static const char *const modes[] = {NULL, "topk_ids,router_logits", "topk_ids"};
    static const char *const mode_names[] = {"all tensors", "no ids, no logits", "no ids"};
    int right = 0, total = 0;
    for (int i = 0; i < n; i++) {
        const dcase *c = &cs[i];
        moe_error err;
        moe_model *m = NULL;
        char dir[1024], dump[1024];
        snprintf(dir, sizeof dir, "%s/%s", MOE_TEST_DATA, c->model);
        snprintf(dump, sizeof dump, "%s/engine-dumps/%s", MOE_TEST_DATA, c->file);
        moe_status st = moe_model_open(dir, &m, &err);
        CHECK_OK(st, err);
        const moe_layer *L = NULL;
        if (st == MOE_OK) st = moe_model_layer(m, c->layer, &L, &err);
        CHECK_OK(st, err);
        for (int md = 0; st == MOE_OK && md < 3; md++) {
            moe_dump d;
            st = moe_dump_load_layer(dump, c->layer, L->cfg.hidden, L->cfg.n_experts, &d, &err);
            CHECK_OK(st, err);
            if (st != MOE_OK) break;
            if (modes[md]) CHECK_OK(moe_dump_drop(&d, modes[md], &err), err);
            moe_diagnosis g;
            st = moe_diagnose(L, &d, &g, &err);
            CHECK_OK(st, err);
            moe_dump_free(&d);
            if (st != MOE_OK) break;
            bool ok_v = !strcmp(moe_verdict_name(g.verdict), c->verdict);
            bool ok_n = g.noise && !strcmp(g.noise, c->noise);
            CHECK(ok_v, "%s layer %d (%s): verdict %s, want %s: %s", c->file, c->layer, mode_names[md],
                  moe_verdict_name(g.verdict), c->verdict, g.sentence);
            CHECK(ok_n, "%s layer %d (%s): noise %s, want %s (%s)", c->file, c->layer, mode_names[md],
                  g.noise ? g.noise : "none", c->noise, g.noise_evidence);
            right += ok_v && ok_n;
            total++;
            if (md == 0 && (c->layer == 3 || !strcmp(c->model, "dsv3-tiny")))
                fprintf(stderr, "  %-50s L%d %-17s %-7s %-6s a=%.4f b=%.4f res=%.2e\n", c->file, c->layer,
                        moe_verdict_name(g.verdict), g.noise ? g.noise : "-", moe_confidence_name(g.confidence), g.fit_a,
                        g.fit_b, g.residual);
        }
        moe_model_free(m);
    }
    fprintf(stderr, "  engine dumps: %d of %d (layer, evidence) cases right in verdict and noise class\n", right, total);
}

/* The CLI over a whole dump: one verdict per layer, a summary, JSON and HTML. */
static void test_cli_all(void) {
    char cmd[4096], json[600], html[600], out[8192];
    moe_t_tmp_path(json, sizeof json, "all.json");
    moe_t_tmp_path(html, sizeof html, "all.html");
    snprintf(cmd, sizeof cmd, "'%s' diagnose --model '%s/dsv4-tiny' --dump '%s/engine-dumps/transformers-h200/"
             "dsv4-tiny-fp32-hash_off_by_one.safetensors' --all --quiet --json '%s' --html '%s'",
             MOE_CLI, MOE_TEST_DATA, MOE_TEST_DATA, json, html);
    int rc = moe_t_sh(cmd, out, sizeof out);
    CHECK(rc == 1, "a dump with broken layers exits 1 (got %d): %s", rc, out);
    CHECK(strstr(out, "summary: 1 of 4 layers OK; SELECTION: 3") != NULL, "summary line: %s", out);
    CHECK(strstr(out, "layer 3: OK") != NULL && strstr(out, "layer 0: SELECTION") != NULL, "per-layer verdicts: %s", out);
    static char buf[1 << 20];
    moe_t_read_file(json, buf, sizeof buf);
    CHECK(strstr(buf, "\"summary\"") && strstr(buf, "\"SELECTION\":\t3"), "JSON summary: %.300s", buf);
    moe_t_read_file(html, buf, sizeof buf);
    CHECK(strstr(buf, "<svg") && strstr(buf, "1 of 4 layers OK") && strstr(buf, "id=\"layer-3\""), "HTML page: %.300s", buf);
    CHECK(strstr(buf, "<script") == NULL && strstr(buf, "http") == strstr(buf, "http://www.w3.org/2000/svg"),
          "HTML loads nothing from elsewhere");
    /* a one-layer dump has no layers.N names: --all says so and exits 2 */
    char one[600];
    moe_t_tmp_path(one, sizeof one, "one.safetensors");
    double v[96] = {0};
    moe_st_entry e[2] = {{.name = "hidden", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {1, 96}, .data = v},
                         {.name = "moe_out", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {1, 96}, .data = v}};
    moe_error err;
    CHECK_OK(moe_st_write(one, e, 2, NULL, &err), err);
    snprintf(cmd, sizeof cmd, "'%s' diagnose --model '%s/dsv4-tiny' --dump '%s' --all 2>&1", MOE_CLI, MOE_TEST_DATA, one);
    rc = moe_t_sh(cmd, out, sizeof out);
    CHECK(rc == 2 && strstr(out, "--layer N"), "--all on a one-layer dump: rc %d: %s", rc, out);
    snprintf(cmd, sizeof cmd, "'%s' diagnose --model '%s/dsv4-tiny' --dump '%s/engine-dumps/transformers-h200/"
             "dsv4-tiny-fp32-none.safetensors' --layer 7 2>&1", MOE_CLI, MOE_TEST_DATA, MOE_TEST_DATA);
    rc = moe_t_sh(cmd, out, sizeof out);
    CHECK(rc == 2, "a layer the checkpoint lacks exits 2 (got %d): %s", rc, out);
    snprintf(cmd, sizeof cmd, "'%s' diagnose --model '%s/dsv4-tiny' --dump '%s/engine-dumps/transformers-h200/"
             "dsv4-tiny-fp32-none.safetensors' --layer 3 --ignore topk_weights,bogus 2>&1", MOE_CLI, MOE_TEST_DATA,
             MOE_TEST_DATA);
    rc = moe_t_sh(cmd, out, sizeof out);
    CHECK(rc == 2 && strstr(out, "bogus"), "--ignore with an unknown name exits 2 naming it (rc %d): %s", rc, out);
}

int main(void) {
    RUN(test_engine_dumps);
    RUN(test_cli_all);
    return moe_t_finish();
}
