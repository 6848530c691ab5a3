/*
 * The moeaudit CLI end to end: exit codes (0 ok, 1 failure, 2 usage/input)
 * and error messages that name the file, tensor and value. Inputs are real
 * safetensors files written with the library's writer.
 */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static char out_buf[65536];

/* Run the CLI with `args`; capture stdout+stderr; return the exit code. */
static int cli(const char *args) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", MOE_CLI, args);
    return moe_t_sh(cmd, out_buf, sizeof out_buf);
}

static const char *tmp(const char *name) {
    static char buf[4][1024];
    static int k;
    k = (k + 1) % 4;
    return moe_t_tmp_path(buf[k], sizeof buf[k], name);
}

/* Write an input file: hidden [T, H] as F32 and optionally input_ids I64. */
static void write_input(const char *path, int64_t T, int H, const float *hidden, const int64_t *ids) {
    moe_st_entry e[2] = {{.name = "hidden", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {T, H}, .data = hidden},
                         {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {T}, .data = ids}};
    moe_error err;
    CHECK_OK(moe_st_write(path, e, ids ? 2 : 1, NULL, &err), err);
}

static void test_help_and_usage(void) {
    CHECK(cli("--help") == 0, "--help exits 0");
    CHECK(strstr(out_buf, "run") != NULL, "help lists run");
    CHECK(cli("run --help") == 0 && strstr(out_buf, "--scale-owner") != NULL, "run --help");
    CHECK(cli("") == 2, "no command is a usage error");
    CHECK(cli("frobnicate") == 2 && strstr(out_buf, "frobnicate") != NULL, "unknown command: %s", out_buf);
    CHECK(cli("run --precision f16") == 2 && strstr(out_buf, "f16") != NULL, "bad precision: %s", out_buf);
    CHECK(cli("run --scale-owner model") == 2, "bad owner");
    CHECK(cli("run --layer") == 2, "missing value");
    CHECK(cli("run --fuse-shared --scale-owner output") == 2, "output owner + fused is refused");
    /* MOE_ISA is the CLI's default ISA: an unknown or unavailable one is a usage error naming the choices */
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "MOE_ISA=sse9 '%s' run 2>&1", MOE_CLI);
    CHECK(moe_t_sh(cmd, out_buf, sizeof out_buf) == 2 && strstr(out_buf, "sse9") && strstr(out_buf, "avx512"),
          "MOE_ISA=sse9: %s", out_buf);
    snprintf(cmd, sizeof cmd, "MOE_ISA=amx '%s' run --precision f32 2>&1", MOE_CLI);
    moe_isa taken;
    if (moe_isa_resolve(MOE_ISA_AMX, &taken, NULL) == MOE_OK) /* an AMX machine: the path runs */
        CHECK(moe_t_sh(cmd, out_buf, sizeof out_buf) == 0, "MOE_ISA=amx: %s", out_buf);
    else
        CHECK(moe_t_sh(cmd, out_buf, sizeof out_buf) == 2 && strstr(out_buf, "available: ref"), "MOE_ISA=amx: %s",
              out_buf);
    snprintf(cmd, sizeof cmd, "MOE_ISA=ref '%s' run --precision f32 2>&1", MOE_CLI);
    CHECK(moe_t_sh(cmd, out_buf, sizeof out_buf) == 0, "MOE_ISA=ref: %s", out_buf);
}

static void test_default_run(void) {
    int rc = cli("run --check");
    CHECK(rc == 0, "default run exits 0: %s", out_buf);
    CHECK(strstr(out_buf, "layer 3: top-k routing") != NULL, "summary names layer 3: %s", out_buf);
    CHECK(strstr(out_buf, "contract check: ok") != NULL, "contract check ran");
}

/* Round trip through files: the output tensors equal the library's. */
static void test_run_files(void) {
    int H = 96, T = 5;
    float hidden[5 * 96];
    int64_t ids[5] = {0, 1, 2, 299, 7};
    for (int i = 0; i < T * H; i++) hidden[i] = (float)sin(0.37 * i);
    const char *in = tmp("in.safetensors"), *out = tmp("out.safetensors");
    write_input(in, T, H, hidden, ids);
    char args[4096];
    snprintf(args, sizeof args, "run --layer 0 --input %s --output %s --scale-owner runner --fuse-shared", in, out);
    CHECK(cli(args) == 0, "run with files: %s", out_buf);
    moe_st_file *f = NULL;
    moe_error err;
    moe_status st = moe_st_open(out, &f, &err);
    CHECK_OK(st, err);
    if (st) return;
    const moe_st_tensor *ti = moe_st_find(f, "topk_ids"), *tw = moe_st_find(f, "topk_weights"),
                        *mo = moe_st_find(f, "moe_out");
    CHECK(ti && ti->dtype == MOE_DTYPE_I32 && ti->shape[0] == T && ti->shape[1] == 4, "topk_ids I32 [5, 4]");
    CHECK(tw && tw->dtype == MOE_DTYPE_F64, "ref precision writes F64");
    CHECK(mo && mo->shape[0] == T && mo->shape[1] == H, "moe_out [5, 96]");
    if (ti && tw) {
        /* runner owner: routed weights sum to 1, the fused shared column is 1/s */
        for (int t = 0; t < T; t++) {
            double s = 0;
            for (int j = 0; j < 3; j++) s += moe_load_f64(tw->data, tw->dtype, (size_t)(t * 4 + j));
            CHECK(fabs(s - 1.0) < 1e-12, "token %d: routed weights sum %.17g, expected 1", t, s);
            CHECK(moe_load_i64(ti->data, ti->dtype, (size_t)(t * 4 + 3)) == 12, "fused column id is E = 12");
            CHECK(fabs(moe_load_f64(tw->data, tw->dtype, (size_t)(t * 4 + 3)) - 1.0 / 1.5) < 1e-15,
                  "fused shared weight 1/s");
        }
    }
    moe_st_close(f);
    snprintf(args, sizeof args, "run --layer 3 --input %s --output %s --precision f32", in, out);
    CHECK(cli(args) == 0, "f32 run: %s", out_buf);
    CHECK(moe_st_open(out, &f, &err) == MOE_OK, "f32 output readable");
    if (f) {
        const moe_st_tensor *m2 = moe_st_find(f, "moe_out");
        CHECK(m2 && m2->dtype == MOE_DTYPE_F32, "f32 precision writes F32");
        moe_st_close(f);
    }
}

static void test_bad_input_files(void) {
    int H = 96;
    float hidden[4 * 96] = {0};
    int64_t ids[4] = {1, 2, 300, 4};
    char args[4096];
    const char *in = tmp("bad_ids.safetensors");
    write_input(in, 4, H, hidden, ids);
    snprintf(args, sizeof args, "run --layer 0 --input %s", in);
    CHECK(cli(args) == 2, "id 300 >= vocab is exit 2");
    CHECK(strstr(out_buf, "input_ids[2] = 300") != NULL, "names token and value: %s", out_buf);

    /* missing input file */
    snprintf(args, sizeof args, "run --input %s", tmp("does-not-exist.safetensors"));
    CHECK(cli(args) == 2 && strstr(out_buf, "does-not-exist") != NULL, "missing file: %s", out_buf);

    /* truncated input file */
    const char *good = tmp("good.safetensors"), *cut = tmp("cut.safetensors");
    ids[2] = 3;
    write_input(good, 4, H, hidden, ids);
    FILE *f = fopen(good, "rb");
    static unsigned char buf[1 << 16];
    size_t n = f ? fread(buf, 1, sizeof buf, f) : 0;
    if (f) fclose(f);
    f = fopen(cut, "wb");
    if (f) { fwrite(buf, 1, n - 100, f); fclose(f); }
    snprintf(args, sizeof args, "run --input %s", cut);
    CHECK(cli(args) == 2 && strstr(out_buf, "cut.safetensors") != NULL, "truncated file: %s", out_buf);

    /* T = 0 */
    const char *empty = tmp("empty.safetensors");
    write_input(empty, 0, H, hidden, ids);
    snprintf(args, sizeof args, "run --input %s", empty);
    CHECK(cli(args) == 2 && strstr(out_buf, "0 tokens") != NULL, "T = 0: %s", out_buf);

    /* wrong hidden size */
    const char *narrow = tmp("narrow.safetensors");
    write_input(narrow, 2, 64, hidden, NULL);
    snprintf(args, sizeof args, "run --input %s", narrow);
    CHECK(cli(args) == 2 && strstr(out_buf, "hidden") != NULL, "wrong H: %s", out_buf);

    /* hash layer without input_ids */
    const char *noids = tmp("noids.safetensors");
    write_input(noids, 2, H, hidden, NULL);
    snprintf(args, sizeof args, "run --layer 1 --input %s", noids);
    CHECK(cli(args) == 2 && strstr(out_buf, "input_ids") != NULL, "hash layer without ids: %s", out_buf);
    snprintf(args, sizeof args, "run --layer 3 --input %s", noids);
    CHECK(cli(args) == 0, "top-k layer needs no ids: %s", out_buf);

    /* NaN in one token: a warning, exit 0 */
    hidden[2 * H + 5] = NAN;
    const char *nan = tmp("nan.safetensors");
    write_input(nan, 4, H, hidden, ids);
    snprintf(args, sizeof args, "run --input %s --check", nan);
    CHECK(cli(args) == 0 && strstr(out_buf, "hidden[2][5]") != NULL, "NaN token warned: %s", out_buf);

    /* dense layer, layer out of range */
    CHECK(cli("run --layer 9") == 2 && strstr(out_buf, "layer 9") != NULL, "layer out of range: %s", out_buf);
}

/* A checkpoint whose config lacks a key, and one that lacks a tensor. */
static void test_bad_checkpoints(void) {
    char args[4096], dir[1024], path[1200];
    moe_t_tmp_path(dir, sizeof dir, "ckpt-nokey");
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (f) { fputs("{\"model_type\": \"deepseek_v4\", \"hidden_size\": 96, \"num_hidden_layers\": 4}\n", f); fclose(f); }
    snprintf(args, sizeof args, "run --model %s", dir);
    CHECK(cli(args) == 2 && strstr(out_buf, "moe_intermediate_size") != NULL, "missing key named: %s", out_buf);

    /* copy of dsv4-tiny without one expert tensor */
    moe_error err;
    moe_st_file *src = NULL;
    CHECK_OK(moe_st_open(moe_t_data("dsv4-tiny/model.safetensors"), &src, &err), err);
    if (!src) return;
    size_t n = moe_st_count(src), k = 0;
    moe_st_entry *e = calloc(n, sizeof *e);
    for (size_t i = 0; i < n; i++) {
        const moe_st_tensor *t = moe_st_at(src, i);
        if (!strcmp(t->name, "model.layers.3.ffn.experts.7.w2.weight")) continue;
        e[k++] = moe_t_st_entry(t);
    }
    moe_t_tmp_path(dir, sizeof dir, "ckpt-notensor");
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK_OK(moe_st_write(path, e, k, NULL, &err), err);
    free(e);
    moe_st_close(src);
    snprintf(path, sizeof path, "cp '%s' '%s/config.json'", moe_t_data("dsv4-tiny/config.json"), dir);
    CHECK(system(path) == 0, "copy config");
    snprintf(args, sizeof args, "run --model %s --layer 3", dir);
    CHECK(cli(args) == 2 && strstr(out_buf, "model.layers.3.ffn.experts.7.w2.weight") != NULL,
          "missing tensor named: %s", out_buf);
    snprintf(args, sizeof args, "run --model %s --layer 2", dir);
    CHECK(cli(args) == 0, "the other layers still run: %s", out_buf);
}

int main(void) {
    RUN(test_help_and_usage);
    RUN(test_default_run);
    RUN(test_run_files);
    RUN(test_bad_input_files);
    RUN(test_bad_checkpoints);
    return moe_t_finish();
}
