/*
 * The JSON every CLI report writes against its schema (docs/schemas/,
 * JSON Schema draft 2020-12): each report is produced by the real CLI on
 * the bundled checkpoints and checked two ways, by the subset validator
 * below (type, required, properties, items, enum, const, minimum, maximum,
 * pattern as ^literal[0-9], oneOf, anyOf, local $ref; cJSON) and, where
 * python3-jsonschema is installed, by the full draft 2020-12 validator. The
 * validator is first shown to reject documents that break a schema, so
 * this test can fail.
 */
#include "harness.h"

#include <cjson/cJSON.h>
#include <ctype.h>

static char out_buf[1 << 16];

/* ------------------------------------------------ the subset validator */

typedef struct vctx {
    cJSON *root;          /* the schema document, for $ref */
    char errs[2048];
    int n_err;
} vctx;

static void verr(vctx *v, const char *where, const char *what) {
    if (v->n_err++ < 6) {
        size_t n = strlen(v->errs);
        snprintf(v->errs + n, sizeof v->errs - n, "%s: %s; ", where[0] ? where : "(document)", what);
    }
}

static bool type_is(const cJSON *d, const char *t) {
    if (!strcmp(t, "object")) return cJSON_IsObject(d);
    if (!strcmp(t, "array")) return cJSON_IsArray(d);
    if (!strcmp(t, "string")) return cJSON_IsString(d);
    if (!strcmp(t, "boolean")) return cJSON_IsBool(d);
    if (!strcmp(t, "null")) return cJSON_IsNull(d);
    if (!strcmp(t, "number")) return cJSON_IsNumber(d);
    if (!strcmp(t, "integer")) return cJSON_IsNumber(d) && d->valuedouble == floor(d->valuedouble);
    return false;
}

static bool json_equal(const cJSON *a, const cJSON *b) { return cJSON_Compare(a, b, true) != 0; }

/* "^literal" followed by at most one "[0-9]": what the schemas use. */
static bool pattern_ok(vctx *v, const char *pat, const char *s, const char *where) {
    if (pat[0] != '^') { verr(v, where, "unsupported pattern (not anchored)"); return false; }
    const char *p = pat + 1;
    for (; *p; p++, s++) {
        if (!strncmp(p, "[0-9]", 5)) {
            if (!isdigit((unsigned char)*s)) return false;
            p += 4;
            continue;
        }
        if (strchr(".*+?()[]{}|\\$", *p)) { verr(v, where, "unsupported pattern construct"); return false; }
        if (*s != *p) return false;
    }
    return true;
}

static void validate(vctx *v, const cJSON *schema, const cJSON *d, const char *where);

/* Valid against schema s? (errors of the trial not kept) */
static bool valid(vctx *v, const cJSON *s, const cJSON *d, const char *where) {
    vctx t = {v->root, "", 0};
    validate(&t, s, d, where);
    return t.n_err == 0;
}

static void validate(vctx *v, const cJSON *schema, const cJSON *d, const char *where) {
    if (!cJSON_IsObject(schema)) return;
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(schema, "$ref");
    if (cJSON_IsString(ref)) {
        if (strncmp(ref->valuestring, "#/$defs/", 8)) { verr(v, where, "unsupported $ref"); return; }
        const cJSON *defs = cJSON_GetObjectItemCaseSensitive(v->root, "$defs");
        const cJSON *target = cJSON_GetObjectItemCaseSensitive(defs, ref->valuestring + 8);
        if (!target) { verr(v, where, "dangling $ref"); return; }
        validate(v, target, d, where);
    }
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(schema, "type");
    if (cJSON_IsString(type) && !type_is(d, type->valuestring)) {
        char m[128];
        snprintf(m, sizeof m, "not of type %s", type->valuestring);
        verr(v, where, m);
        return;
    }
    if (cJSON_IsArray(type)) {
        bool any = false;
        const cJSON *t;
        cJSON_ArrayForEach(t, type) any |= cJSON_IsString(t) && type_is(d, t->valuestring);
        if (!any) { verr(v, where, "not of any allowed type"); return; }
    }
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(schema, "const");
    if (c && !json_equal(c, d)) verr(v, where, "not the const value");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(schema, "enum");
    if (cJSON_IsArray(en)) {
        bool any = false;
        const cJSON *e;
        cJSON_ArrayForEach(e, en) any |= json_equal(e, d);
        if (!any) verr(v, where, cJSON_IsString(d) ? d->valuestring : "not among the enum values");
    }
    const cJSON *mn = cJSON_GetObjectItemCaseSensitive(schema, "minimum"),
                *mx = cJSON_GetObjectItemCaseSensitive(schema, "maximum");
    if (cJSON_IsNumber(d) && cJSON_IsNumber(mn) && d->valuedouble < mn->valuedouble) verr(v, where, "below minimum");
    if (cJSON_IsNumber(d) && cJSON_IsNumber(mx) && d->valuedouble > mx->valuedouble) verr(v, where, "above maximum");
    const cJSON *pat = cJSON_GetObjectItemCaseSensitive(schema, "pattern");
    if (cJSON_IsString(pat) && cJSON_IsString(d) && !pattern_ok(v, pat->valuestring, d->valuestring, where))
        verr(v, where, "does not match the pattern");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(schema, "required");
    if (cJSON_IsObject(d) && cJSON_IsArray(req)) {
        const cJSON *k;
        cJSON_ArrayForEach(k, req)
            if (cJSON_IsString(k) && !cJSON_GetObjectItemCaseSensitive(d, k->valuestring)) {
                char m[160];
                snprintf(m, sizeof m, "required key \"%s\" missing", k->valuestring);
                verr(v, where, m);
            }
    }
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(schema, "properties");
    if (cJSON_IsObject(d) && cJSON_IsObject(props)) {
        const cJSON *p;
        cJSON_ArrayForEach(p, props) {
            const cJSON *sub = cJSON_GetObjectItemCaseSensitive(d, p->string);
            if (!sub) continue;
            char w[512];
            snprintf(w, sizeof w, "%s/%s", where, p->string);
            validate(v, p, sub, w);
        }
    }
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(schema, "items");
    if (cJSON_IsArray(d) && cJSON_IsObject(items)) {
        int i = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, d) {
            char w[512];
            snprintf(w, sizeof w, "%s/%d", where, i++);
            validate(v, items, e, w);
        }
    }
    const cJSON *one = cJSON_GetObjectItemCaseSensitive(schema, "oneOf"), *any = cJSON_GetObjectItemCaseSensitive(schema, "anyOf");
    if (cJSON_IsArray(one) || cJSON_IsArray(any)) {
        int n = 0;
        const cJSON *list = cJSON_IsArray(one) ? one : any, *s;
        cJSON_ArrayForEach(s, list) n += valid(v, s, d, where);
        if (cJSON_IsArray(one) && n != 1) verr(v, where, n ? "valid against more than one of oneOf" : "valid against none of oneOf");
        if (cJSON_IsArray(any) && n == 0) verr(v, where, "valid against none of anyOf");
    }
}

static cJSON *load_json(const char *path) {
    static char buf[1 << 22];
    if (!moe_t_read_file(path, buf, sizeof buf)) return NULL;
    return cJSON_Parse(buf);
}

static char schema_dir[1024];

static cJSON *load_schema(const char *name) {
    char p[1200];
    snprintf(p, sizeof p, "%s/%s.schema.json", schema_dir, name);
    cJSON *s = load_json(p);
    CHECK(s != NULL, "%s parses", p);
    return s;
}

/* Both validators on doc_path against schema `name`. */
static void check_doc(const char *name, const char *doc_path, const char *what) {
    cJSON *s = load_schema(name), *d = load_json(doc_path);
    CHECK(d != NULL, "%s: the output is JSON", what);
    if (s && d) {
        vctx v = {s, "", 0};
        validate(&v, s, d, "");
        CHECK(v.n_err == 0, "%s against %s.schema.json: %s", what, name, v.errs);
    }
    cJSON_Delete(s);
    cJSON_Delete(d);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "python3 '%s/tests/validate_schema.py' '%s/%s.schema.json' '%s' 2>&1", MOE_SOURCE_DIR,
             schema_dir, name, doc_path);
    int rc = moe_t_sh(cmd, out_buf, sizeof out_buf);
    static bool noted;
    if (rc == 77 || rc == 127 || rc < 0) {
        if (!noted) fprintf(stderr, "  note: python3-jsonschema not installed: the full draft 2020-12 check skipped\n");
        noted = true;
    } else {
        CHECK(rc == 0, "%s: jsonschema (draft 2020-12): %s", what, out_buf);
    }
}

static int cli(const char *args) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", MOE_CLI, args);
    return moe_t_sh(cmd, out_buf, sizeof out_buf);
}

/* ------------------------------------------------------------- tests */

static void test_schemas_are_schemas(void) {
    static const char *const names[] = {"audit", "diagnose", "needle", "bisect", "hc", "bench", "bench-cuda", "inspect"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        cJSON *s = load_schema(names[i]);
        const cJSON *d = cJSON_GetObjectItem(s, "$schema"), *id = cJSON_GetObjectItem(s, "$id");
        CHECK(cJSON_IsString(d) && !strcmp(d->valuestring, "https://json-schema.org/draft/2020-12/schema") &&
                  cJSON_IsString(id), "%s: draft 2020-12, with an $id", names[i]);
        const cJSON *req = cJSON_GetObjectItem(s, "required");
        bool has_v = false, has_t = false;
        const cJSON *k;
        cJSON_ArrayForEach(k, req) {
            has_v |= !strcmp(k->valuestring, "schema_version");
            has_t |= !strcmp(k->valuestring, "tool");
        }
        CHECK(has_v && has_t, "%s requires schema_version and tool", names[i]);
        cJSON_Delete(s);
    }
}

/* The validator rejects what breaks a schema (so the checks below can fail). */
static void test_validator_rejects(void) {
    cJSON *s = load_schema("audit");
    const char *doc = "{\"schema_version\": 1, \"tool\": \"moeaudit 0.1.0\", \"report\": \"audit\", \"model\": \"m\", "
                      "\"tokens\": 8, \"isa\": \"avx2\", \"seconds\": 1, \"headline\": \"h\", \"summary\": {\"rows\": 1, "
                      "\"layers\": 1, \"pass\": 1, \"marginal\": 0, \"fail\": 0, \"contract_broken\": 0, \"not_run\": 0, "
                      "\"worst\": null}, \"grading\": {\"pass_sqnr_db\": 25, \"marginal_sqnr_db\": 12, "
                      "\"pass_flip_fraction\": 0.01, \"marginal_flip_fraction\": 0.05}, \"rows\": [{\"layer\": 0, "
                      "\"layer_kind\": \"hash\", \"id\": \"act.bf16\", \"path\": \"p\", \"group\": \"activations\", "
                      "\"precision\": \"f32\", \"activations\": \"bf16\", \"router\": \"path\", \"weights\": \"none\", "
                      "\"shared_weights\": \"none\", \"scale_owner\": \"router\", \"fused_shared\": false, \"isa\": "
                      "\"avx2\", \"grade\": \"PASS\", \"max_abs\": 1, \"max_rel\": 1, \"nmse\": 1e-5, \"sqnr_db\": 50, "
                      "\"routing_flips\": 0, \"tokens\": 8, \"seconds\": 0.1}]}";
    static const struct { const char *what, *find, *repl; } breaks[] = {
        {"as written", NULL, NULL},
        {"no rows", "\"rows\": [", "\"rowz\": ["},
        {"a grade outside the enum", "\"PASS\"", "\"GOOD\""},
        {"a count of the wrong type", "\"tokens\": 8,", "\"tokens\": \"8\","},
        {"the wrong schema_version", "\"schema_version\": 1", "\"schema_version\": 2"},
        {"a tool that is not moeaudit", "moeaudit 0.1.0", "other 1.0"},
        {"a row with neither numbers nor an error", "\"max_abs\": 1, ", ""},
        {"a negative minimum", "\"routing_flips\": 0", "\"routing_flips\": -1"},
    };
    for (size_t i = 0; i < sizeof breaks / sizeof breaks[0]; i++) {
        char buf[4096];
        snprintf(buf, sizeof buf, "%s", doc);
        if (breaks[i].find) {
            char *p = strstr(buf, breaks[i].find);
            CHECK(p != NULL, "break '%s' applies", breaks[i].what);
            if (!p) continue;
            char tail[4096];
            snprintf(tail, sizeof tail, "%s", p + strlen(breaks[i].find));
            snprintf(p, sizeof buf - (size_t)(p - buf), "%s%s", breaks[i].repl, tail);
        }
        cJSON *d = cJSON_Parse(buf);
        vctx v = {s, "", 0};
        validate(&v, s, d, "");
        if (!breaks[i].find) CHECK(d && v.n_err == 0, "the valid document passes: %s", v.errs);
        else CHECK(v.n_err > 0, "%s is rejected", breaks[i].what);
        cJSON_Delete(d);
    }
    cJSON_Delete(s);
}

static void write_tensors(const char *path, const moe_st_entry *e, size_t n) {
    moe_error err;
    CHECK_OK(moe_st_write(path, e, n, NULL, &err), err);
}

static void test_cli_reports(void) {
    char args[4096], out[1024];
    /* audit: numbers rows, rows that could not run (FP4 on I = 40) */
    moe_t_tmp_path(out, sizeof out, "audit.json");
    snprintf(args, sizeof args, "audit --model dsv4-tiny --layers 2,3 --tokens 8 --paths contract,act.bf16,act.nvfp4,weights.mxfp4 --quiet --json %s", out);
    CHECK(cli(args) == 0, "audit: %s", out_buf);
    check_doc("audit", out, "audit --json");

    /* diagnose: a dump of the float64 block itself (verdict OK) */
    moe_error err;
    moe_model *m = NULL;
    CHECK_OK(moe_model_open(moe_t_data("dsv4-tiny"), &m, &err), err);
    const moe_layer *L = NULL;
    if (m) CHECK_OK(moe_model_layer(m, 3, &L, &err), err);
    if (L) {
        enum { T = 6 };
        int H = L->cfg.hidden;
        double *x = malloc(sizeof(double) * T * (size_t)H);
        int64_t ids[T] = {1, 2, 3, 4, 5, 6};
        for (int i = 0; i < T * H; i++) x[i] = sin(0.29 * i) * (i % H == 4 ? 5 : 1);
        moe_run_opts o = moe_run_opts_default();
        moe_block_out b;
        CHECK_OK(moe_block_out_init(&b, L, T, &o, &err), err);
        CHECK_OK(moe_block_run(L, x, ids, T, &o, &b, &err), err);
        moe_st_entry e[3] = {{.name = "hidden", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {T, H}, .data = x},
                             {.name = "moe_out", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {T, H}, .data = b.moe_out},
                             {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {T}, .data = ids}};
        char dump[1024];
        moe_t_tmp_path(dump, sizeof dump, "dump.safetensors");
        write_tensors(dump, e, 3);
        moe_t_tmp_path(out, sizeof out, "diagnose.json");
        snprintf(args, sizeof args, "diagnose --model dsv4-tiny --layer 3 --dump %s --json %s", dump, out);
        CHECK(cli(args) == 0, "diagnose of the reference itself: OK: %s", out_buf);
        check_doc("diagnose", out, "diagnose --json");
        moe_block_out_free(&b);
        free(x);
    }
    moe_model_free(m);
    /* diagnose --all: every layer of a real engine's dump (transformers on the H200, hash ids off by one) */
    moe_t_tmp_path(out, sizeof out, "diagnose-all.json");
    snprintf(args, sizeof args, "diagnose --model dsv4-tiny --dump %s/engine-dumps/transformers-h200/"
                                "dsv4-tiny-fp32-hash_off_by_one.safetensors --all --quiet --json %s", MOE_TEST_DATA, out);
    CHECK(cli(args) == 1, "diagnose --all on a broken engine: exit 1: %s", out_buf);
    check_doc("diagnose", out, "diagnose --all --json");

    /* needle: the synthetic sweep and real tensors */
    moe_t_tmp_path(out, sizeof out, "needle.json");
    snprintf(args, sizeof args, "needle --len 1024,2048 --depths 0,0.5,1 --topk 128 --trials 1 --heads 4 --dim 32 "
                                "--json %s --quiet", out);
    CHECK(cli(args) == 0, "needle: %s", out_buf);
    check_doc("needle", out, "needle --json");
    {
        enum { Tq = 3, Hh = 2, D = 16, S = 40 };
        static float q[Tq * Hh * D], k[S * D], w[Tq * Hh];
        for (int i = 0; i < Tq * Hh * D; i++) q[i] = (float)sin(0.7 * i);
        for (int i = 0; i < S * D; i++) k[i] = (float)cos(0.3 * i);
        for (int i = 0; i < Tq * Hh; i++) w[i] = 0.5f;
        moe_st_entry e[3] = {{.name = "q", .dtype = MOE_DTYPE_F32, .ndim = 3, .shape = {Tq, Hh, D}, .data = q},
                             {.name = "k", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {S, D}, .data = k},
                             {.name = "w", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {Tq, Hh}, .data = w}};
        char tens[1024];
        moe_t_tmp_path(tens, sizeof tens, "needle-tensors.safetensors");
        write_tensors(tens, e, 3);
        moe_t_tmp_path(out, sizeof out, "needle-tensors.json");
        snprintf(args, sizeof args, "needle --tensors %s --topk 8 --ratio 1 --precisions f32,fp8,fp4 --json %s", tens, out);
        CHECK(cli(args) == 0, "needle --tensors: %s", out_buf);
        check_doc("needle", out, "needle --tensors --json");
    }

    /* bisect: one bisect (a harmful deployment exits 1), the grid alone, and both */
    moe_t_tmp_path(out, sizeof out, "bisect.json");
    snprintf(args, sizeof args, "bisect --model dsv4-attn --length 64 --patches kv-fp8,mhc-bf16 --json %s --quiet", out);
    int brc = cli(args);
    CHECK(brc == 0 || brc == 1, "bisect: %s", out_buf);
    check_doc("bisect", out, "bisect --json");
    moe_t_tmp_path(out, sizeof out, "bisect-grid.json");
    snprintf(args, sizeof args, "bisect --model dsv4-attn --sweep-length 40..64:24 --depths 0.2,0.8 --patches kv-fp8 "
                                "--json %s --quiet", out);
    brc = cli(args);
    CHECK(brc == 0 || brc == 1, "bisect --sweep-length: %s", out_buf);
    check_doc("bisect", out, "bisect --sweep-length --json");
    moe_t_tmp_path(out, sizeof out, "bisect-both.json");
    snprintf(args, sizeof args, "bisect --model dsv4-attn --length 48 --sweep-length 40..64:24 --depths 0.5 "
                                "--patches index-keys-fp4-norot --json %s --quiet", out);
    brc = cli(args);
    CHECK(brc == 0 || brc == 1, "bisect --length --sweep-length: %s", out_buf);
    check_doc("bisect", out, "bisect --length --sweep-length --json");

    /* run --block hc_*: the summary and the audit */
    moe_t_tmp_path(out, sizeof out, "hc.json");
    snprintf(args, sizeof args, "run --block hc_ffn --tokens 3 --precision bf16 --json %s", out);
    CHECK(cli(args) == 0, "hc run: %s", out_buf);
    check_doc("hc", out, "run --block hc_ffn --json");
    moe_t_tmp_path(out, sizeof out, "hc-audit.json");
    snprintf(args, sizeof args, "run --block hc_attn --layer 1 --tokens 3 --audit --json %s", out);
    CHECK(cli(args) == 0, "hc audit: %s", out_buf);
    check_doc("hc", out, "run --block hc_attn --audit --json");

    /* bench (CPU): one small row */
    moe_t_tmp_path(out, sizeof out, "bench.json");
    snprintf(args, sizeof args, "bench --weights bf16 --tokens 1 --iters 1 --experts 6 --max-gib 0.05 --json %s", out);
    CHECK(cli(args) == 0, "bench: %s", out_buf);
    check_doc("bench", out, "bench --json");
    /* bench: an NVFP4-activation row (W4A4) */
    moe_t_tmp_path(out, sizeof out, "bench-nvfp4.json");
    snprintf(args, sizeof args, "bench --weights nvfp4 --act nvfp4 --tokens 1 --iters 1 --experts 6 --max-gib 0.05 --json %s", out);
    CHECK(cli(args) == 0, "bench --act nvfp4: %s", out_buf);
    check_doc("bench", out, "bench --act nvfp4 --json");

    /* inspect: the V4-Flash release-layout dataset (MTP, FP8 indexer, 3 shards) and a V3 FP8 checkpoint */
    moe_t_tmp_path(out, sizeof out, "inspect.json");
    snprintf(args, sizeof args, "inspect --model %s/dsv4-flash-layout --quiet --json %s", MOE_TEST_DATA, out);
    CHECK(cli(args) == 0, "inspect: %s", out_buf);
    check_doc("inspect", out, "inspect --json");
    moe_t_tmp_path(out, sizeof out, "inspect-v3.json");
    snprintf(args, sizeof args, "inspect --model dsv3-tiny-fp8 --quiet --json %s", out);
    CHECK(cli(args) == 0, "inspect dsv3-tiny-fp8: %s", out_buf);
    check_doc("inspect", out, "inspect dsv3-tiny-fp8 --json");
}

int main(void) {
    snprintf(schema_dir, sizeof schema_dir, "%s/docs/schemas", MOE_SOURCE_DIR);
    RUN(test_schemas_are_schemas);
    RUN(test_validator_rejects);
    RUN(test_cli_reports);
    fprintf(stderr, "  note: bench --device cuda (bench-cuda.schema.json) needs a GPU: its schema is checked, not an output\n");
    return moe_t_finish();
}
