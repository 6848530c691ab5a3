/*
 * The moeaudit CLI end to end: exit codes (0 ok, 1 failure, 2 usage/input)
 * and error messages that name the file, tensor and value. Inputs are real
 * safetensors files written with the library's writer.
 */
#include "harness.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char out_buf[1 << 20];

/* Run the CLI with `args`; capture stdout+stderr; return the exit code. */
static int cli(const char *args) {
    char cmd[8192];
    moe_t_fits(cmd, sizeof cmd, snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", MOE_CLI, args));
    return moe_t_sh(cmd, out_buf, sizeof out_buf);
}

/* The same, stdout alone (stderr dropped). */
static int cli_stdout(const char *args) {
    char cmd[8192];
    moe_t_fits(cmd, sizeof cmd, snprintf(cmd, sizeof cmd, "'%s' %s 2>/dev/null", MOE_CLI, args));
    return moe_t_sh(cmd, out_buf, sizeof out_buf);
}

/* The last output, copied into dst [cap] (truncated). */
static void keep(char *dst, size_t cap) {
    size_t n = strlen(out_buf);
    if (n >= cap) n = cap - 1;
    memcpy(dst, out_buf, n);
    dst[n] = 0;
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


/* Every command: --help exits 0 and names every option of its table
 * ('help --options CMD' lists the table); 'help CMD' prints the same. */
static const char *const commands[] = {"run", "forward", "audit", "bench", "diagnose", "needle", "bisect", "quantize",
                                       "inspect"};

static void test_help_every_command(void) {
    static char help[1 << 16], help2[1 << 16], opts[8192];
    CHECK(cli("--help") == 0, "--help");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        const char *c = commands[i];
        CHECK(strstr(out_buf, c) != NULL, "top-level help lists %s", c);
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        const char *c = commands[i];
        char args[256];
        snprintf(args, sizeof args, "%s --help", c);
        CHECK(cli(args) == 0, "%s --help exits 0", c);
        keep(help, sizeof help);
        snprintf(args, sizeof args, "help %s", c);
        CHECK(cli(args) == 0, "help %s exits 0", c);
        keep(help2, sizeof help2);
        CHECK(!strcmp(help, help2), "help %s = %s --help", c, c);
        snprintf(args, sizeof args, "help --options %s", c);
        CHECK(cli(args) == 0, "help --options %s", c);
        keep(opts, sizeof opts);
        int n = 0;
        for (char *save = NULL, *o = strtok_r(opts, "\n", &save); o; o = strtok_r(NULL, "\n", &save), n++) {
            char want[128];
            snprintf(want, sizeof want, "  %s ", o); /* listed as an option line */
            char want2[128];
            snprintf(want2, sizeof want2, "  %s\n", o);
            CHECK(strstr(help, want) || strstr(help, want2), "%s --help mentions %s", c, o);
        }
        CHECK(n >= 3, "%s has an option table (%d options)", c, n);
    }
    CHECK(cli("help frobnicate") == 2, "help of an unknown command: exit 2");
}

/* One table of spellings: what each gives (exit code, a word of the message). */
static void test_option_spellings(void) {
    static const struct { const char *args; int rc; const char *says; } t[] = {
        {"run --layer 3 --tokens 4", 0, "layer 3: top-k"},
        {"run --layer=3 --tokens=4", 0, "layer 3: top-k"},
        {"run --frobnicate", 2, "unknown option '--frobnicate'"},
        {"run --layr 3", 2, "did you mean --layer"},
        {"run --layer", 2, "--layer needs a value"},
        {"run --layer=", 2, "--layer needs a value"},
        {"run --model --layer 3", 2, "--model needs a value"},
        {"run --layer x", 2, "--layer x"},
        {"run --layer -1", 2, "--layer -1"},
        {"run --check=yes", 2, "--check takes no value"},
        {"run --precision f16", 2, "--precision f16: expected ref or f32"},
        {"run --precision=fp8", 2, "--precision fp8"},
        {"run --act fp4", 2, "--act fp4: expected exact, bf16, fp8, fp8-f32scale, nvfp4 or nvfp4-expert"},
        {"run --layer 3 --act nvfp4", 2, "needs the static input scales of every routed expert"},
        {"run --device cuda --act nvfp4", 2, "--act nvfp4: expected bf16, fp8 or fp8-f32scale"},
        {"run --scale-owner=model", 2, "--scale-owner model: expected router, runner or output"},
        {"run stray", 2, "unexpected argument 'stray'"},
        {"run --compare", 2, "--compare applies to --device cuda only"},
        {"run --placement p.txt", 2, "--placement applies to --ep N only"},
        {"forward --placement p.txt", 2, "--placement applies to --ep N only"},
        {"run --block hc_ffn --act bf16", 2, "--act applies to"},
        {"run --block hc_ffn --precision fp8", 2, "--precision fp8: expected ref, f32, tf32, bf16 or bf16-split"},
        {"run --device cuda --precision ref", 2, "does not compute in float64"},
        {"run --device cuda --act exact", 2, "never unrounded"},
        {"run --device gpu", 2, "--device gpu: expected cpu or cuda"},
        {"run --isa avx9", 2, "--isa avx9"},
        {"run --isa=ref --layer 3 --tokens 2 --precision f32", 0, "layer 3: top-k"},
        {"run --device cuda --isa ref", 2, "--isa applies to"},
        {"run --ep 2 --device cuda", 2, "cannot be combined"},
        {"audit --fail-on PASS", 2, "--fail-on PASS: expected"},
        {"audit --paths nope", 2, "'nope' is neither a path id nor a group"},
        {"audit --paths list", 0, "weights.mxfp4"},
        {"audit --json - --html -", 2, "both write to stdout"},
        {"audit --input x.safetensors --tokens 8", 2, "with --input the file says T"},
        {"bench --path gemv", 2, "--path applies to --device cuda only"},
        {"bench --ep 2 --shape v3", 2, "--shape applies to"},
        {"bench --weights fp4", 2, "'fp4' is not one of"},
        {"bench --tokens 1,,2", 2, "--tokens 1,,2"},
        {"bench --linear --ep 2", 2, "cannot be combined"},
        {"bench --linear --layer-cost", 2, "cannot be combined"},
        {"bench --linear --ratios 0,4", 2, "--ratios applies to --write-v4flash only"},
        {"bench --clock cpu", 2, "--clock applies to --linear, --layer-cost only"},
        {"bench --linear --clock gpu", 2, "--clock gpu: expected wall or cpu"},
        {"bench --linear --precision bf16", 2, "--precision bf16: expected ref or f32"},
        {"bench --linear --shapes 99", 2, "--shapes: '99' is neither a row number"},
        {"bench --layer-cost --tokens 64", 2, "at least 128 tokens"},
        {"bench --layer-cost --tokens 256,4096", 2, "one prompt length"},
        {"bench --write-v4flash d --ratios 0,5", 2, "--ratios takes 0, 4 or 128"},
        {"needle --json", 2, "--json needs a value"},
        {"needle --precisions f32,fp9", 2, "--precisions fp9: expected f32, bf16, fp8, fp8-f32scale or fp4"},
        {"needle --dim 100", 2, "power of two"},
        {"bisect", 2, "--patches LIST is required"},
        {"bisect --patches mhc-bf16 --length 4", 2, "--length 4: expected an integer from 8"},
        {"bisect --pathces mhc-bf16", 2, "did you mean --patches"},
        {"bisect --patches mhc-bf16 --depth=2", 2, "--depth 2: expected a number in [0, 1]"},
        {"bisect --patches mhc-bf16 --json - --html -", 2, "both write to stdout"},
        {"bisect --patches mhc-bf61 --length 64", 2, "closest: mhc-bf16"},
        {"bisect --list-patches", 0, "scale-double"},
        {"quantize --experts fp4", 2, "--experts fp4: expected mxfp4, nvfp4 or fp8"},
        {"quantize --scale-fmt e8m0", 2, "--scale-fmt e8m0: expected float or ue8m0"},
        {"quantize --calib", 2, "--calib needs a value"},
        {"bench --act nvfp4-expert", 2, "--act nvfp4-expert: expected"},
        {"inspect --jso x", 2, "did you mean --json"},
        {"inspect --model /nonexistent/ckpt", 2, "/nonexistent/ckpt"},
        {"inspect --model dsv3-tiny-fp8 --layer 1", 2, "unknown option '--layer'"},
        {"inspect --model dsv3-tiny-fp8", 0, "dense layer"},
        {"diagnose --model x", 2, "are required"},
        {"diagnose --model dsv4-tiny --dump d --layer 1 --all", 2, "--layer and --all exclude each other"},
        {"forward --layers 3..1", 2, "--layers 3..1"},
        {"forward --chunks 4,0", 2, "--chunks 4,0"},
        {"forward --precision bf16", 2, "--precision bf16: expected ref or f32"},
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        int rc = cli(t[i].args);
        CHECK(rc == t[i].rc && strstr(out_buf, t[i].says) != NULL, "'%s': exit %d (want %d), says: %.300s", t[i].args,
              rc, t[i].rc, out_buf);
    }
    /* --x=v and --x v are the same run */
    static char a[1 << 16];
    cli("run --layer 2 --tokens 5 --precision f32 --act bf16");
    keep(a, sizeof a);
    cli("run --layer=2 --tokens=5 --precision=f32 --act=bf16");
    CHECK(!strcmp(a, out_buf) && strstr(a, "activations bf16"), "--x=v = --x v: %.200s", out_buf);
    /* the older spellings still parse */
    CHECK(cli("quantize --model a --out b --experts mxfp4") == 2 && strstr(out_buf, "a") != NULL &&
              !strstr(out_buf, "unknown option"), "quantize --out (older spelling of --output): %s", out_buf);
    CHECK(cli("run --block hc_ffn --tokens 2 --precision fp32") == 0 && strstr(out_buf, "precision f32"),
          "fp32 is read as f32: %s", out_buf);
}

/* '-' is stdout for every output option: the same bytes as a file. */
static void test_stdout_outputs(void) {
    char args[4096], cmd[8192];
    const char *f1 = tmp("so-file.safetensors"), *f2 = tmp("so-stdout.safetensors");
    snprintf(args, sizeof args, "run --layer 3 --tokens 4 --output %s", f1);
    CHECK(cli(args) == 0, "run --output FILE: %s", out_buf);
    snprintf(cmd, sizeof cmd, "'%s' run --layer 3 --tokens 4 --output - > '%s' 2>/dev/null", MOE_CLI, f2);
    CHECK(system(cmd) == 0, "run --output -");
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", f1, f2);
    CHECK(system(cmd) == 0, "--output - writes the file's bytes, and nothing else, to stdout");
    /* JSON reports to stdout parse as JSON and carry the document header */
    static const char *const json_cmds[] = {
        "run --block hc_ffn --tokens 3 --json -",
        "run --block hc_attn --tokens 3 --audit --json -",
        "needle --len 2048 --depths 0,1 --topk 128 --trials 1 --heads 4 --dim 32 --precisions f32,fp8 --json -",
        "audit --model dsv4-tiny --layers 3 --tokens 8 --paths contract --json -",
        "bisect --model dsv4-attn --length 64 --patches mhc-bf16 --json -",
    };
    for (size_t i = 0; i < sizeof json_cmds / sizeof json_cmds[0]; i++) {
        CHECK(cli_stdout(json_cmds[i]) == 0, "%s exits 0", json_cmds[i]);
        cJSON *j = cJSON_Parse(out_buf);
        CHECK(j != NULL, "%s: stdout is one JSON document: %.200s", json_cmds[i], out_buf);
        if (!j) continue;
        cJSON *v = cJSON_GetObjectItem(j, "schema_version"), *tool = cJSON_GetObjectItem(j, "tool");
        CHECK(cJSON_IsNumber(v) && v->valueint == 1 && cJSON_IsString(tool) && !strcmp(tool->valuestring, "moeaudit " MOEAUDIT_VERSION),
              "%s: schema_version and tool", json_cmds[i]);
        cJSON_Delete(j);
    }
    /* the HTML page to stdout */
    CHECK(cli_stdout("audit --model dsv4-tiny --layers 3 --tokens 8 --paths contract --html -") == 0 &&
              !strncmp(out_buf, "<!DOCTYPE html>", 15) && strstr(out_buf, "</html>"), "--html -: %.100s", out_buf);
}

/* The bundled checkpoints by name, found beside the executable. */
static void test_bundled_models(void) {
    CHECK(cli("run --model dsv3-tiny --layer 1 --tokens 2") == 0 && strstr(out_buf, "dsv3-tiny"), "--model dsv3-tiny: %s",
          out_buf);
    CHECK(cli("run --model no-such-model --layer 1") == 2 && strstr(out_buf, "no-such-model"), "unknown model named: %s",
          out_buf);
    char args[2048];
    snprintf(args, sizeof args, "MOEAUDIT_DATA='%s' '%s' run --layer 3 --tokens 2 2>&1", moe_t_data(""), MOE_CLI);
    CHECK(moe_t_sh(args, out_buf, sizeof out_buf) == 0, "MOEAUDIT_DATA: %s", out_buf);
    snprintf(args, sizeof args, "MOEAUDIT_DATA=/nonexistent '%s' run --layer 3 2>&1", MOE_CLI);
    CHECK(moe_t_sh(args, out_buf, sizeof out_buf) == 2 && strstr(out_buf, "dsv4-tiny was not found"),
          "no bundled checkpoint: says where it looked: %s", out_buf);
}

/* The man page, from the same tables: every option of every command. */
static void test_man_page(void) {
    static char man[1 << 18], opts[8192];
    CHECK(cli_stdout("help --man") == 0 && !strncmp(out_buf, ".\\\"", 3) && strstr(out_buf, ".TH MOEAUDIT 1"),
          "help --man: %.80s", out_buf);
    keep(man, sizeof man);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        char args[256];
        snprintf(args, sizeof args, "help --options %s", commands[i]);
        cli(args);
        keep(opts, sizeof opts);
        for (char *save = NULL, *o = strtok_r(opts, "\n", &save); o; o = strtok_r(NULL, "\n", &save)) {
            char want[160] = "\\fB";
            size_t k = strlen(want);
            for (const char *p = o; *p && k + 3 < sizeof want; p++) {
                if (*p == '-') want[k++] = '\\';
                want[k++] = *p;
            }
            want[k] = 0;
            CHECK(strstr(man, want) != NULL, "man page has %s of %s", o, commands[i]);
        }
    }
    /* groff parses it without a warning, where groff is installed */
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "command -v groff >/dev/null || exit 77; '%s' help --man | groff -man -ww -z 2>&1",
             MOE_CLI);
    int rc = moe_t_sh(cmd, out_buf, sizeof out_buf);
    if (rc == 77) fprintf(stderr, "  note: groff not installed: man page rendering not checked\n");
    else CHECK(rc == 0 && out_buf[0] == 0, "groff -man -ww: %s", out_buf);
}

/* A small synthetic checkpoint: H 256, I 128, E 16, K 4 (the shapes on which
 * test-audit pins each path's grade class), n_layers layers. */
static const char *synth_ckpt(const char *name, int n_layers, int hidden, int inter, int experts, int top_k) {
    static char dir[4][1024];
    static int k;
    k = (k + 1) % 4;
    moe_t_tmp_path(dir[k], sizeof dir[k], name);
    moe_synth_opts so = moe_synth_opts_default();
    so.hidden = hidden;
    so.inter = inter;
    so.n_experts = experts;
    so.top_k = top_k;
    so.n_layers = n_layers;
    so.n_hash_layers = n_layers > 2 ? 2 : 1;
    moe_error err;
    CHECK_OK(moe_synth_write(dir[k], &so, &err), err);
    return dir[k];
}

/* audit as a CI gate: --fail-on, --paths, --input, the summary and the
 * per-layer progress lines (stderr is a pipe here). */
static void test_audit_gate(void) {
    const char *dir = synth_ckpt("gate", 2, 256, 128, 16, 4);
    char args[4096];
    /* MXFP4 experts grade MARGINAL on these shapes (the tolerance table, test-audit) */
    snprintf(args, sizeof args, "audit --model %s --tokens 32 --paths weights.mxfp4,contract --fail-on MARGINAL", dir);
    int rc = cli(args);
    CHECK(rc == 1, "--fail-on MARGINAL with MARGINAL rows exits 1 (got %d): %s", rc, out_buf);
    CHECK(strstr(out_buf, "--fail-on MARGINAL: layer 0 mxfp4 experts (weights.mxfp4): MARGINAL") != NULL,
          "names the row: %s", out_buf);
    CHECK(strstr(out_buf, "layer 0 done (1/2)") && strstr(out_buf, "layer 1 done (2/2)"), "one progress line per layer");
    CHECK(strstr(out_buf, "audit: 12 rows on 2 layers") && strstr(out_buf, " 0 FAIL, 2 MARGINAL, 10 PASS"),
          "summary counts: %s", out_buf);
    snprintf(args, sizeof args, "audit --model %s --tokens 32 --paths weights.mxfp4,contract --fail-on FAIL", dir);
    CHECK(cli(args) == 0, "--fail-on FAIL without FAIL rows exits 0: %s", out_buf);
    snprintf(args, sizeof args, "audit --model %s --tokens 32 --paths weights.mxfp4", dir);
    CHECK(cli(args) == 0 && strstr(out_buf, "MARGINAL"), "no --fail-on: exit 0 whatever the grades");
    snprintf(args, sizeof args, "audit --model %s --tokens 32 --paths contract --fail-on MARGINAL --quiet", dir);
    CHECK(cli(args) == 0 && !strstr(out_buf, "sorted by harm"), "contract rows all PASS; --quiet prints no table");

    /* --input: real activations, one file for every layer or one per layer */
    int64_t T = 11;
    int H = 256;
    float *hidden = malloc((size_t)(T * H) * sizeof *hidden);
    int64_t ids[11];
    for (int64_t i = 0; i < T * H; i++) hidden[i] = (float)sin(0.11 * (double)i) * (i % H == 3 ? 6.0f : 1.0f);
    for (int t = 0; t < T; t++) ids[t] = t * 5;
    const char *in = tmp("audit-in.safetensors"), *j = tmp("audit-in.json");
    write_input(in, T, H, hidden, ids);
    snprintf(args, sizeof args, "audit --model %s --input %s --paths act --json %s", dir, in, j);
    CHECK(cli(args) == 0, "audit --input: %s", out_buf);
    static char buf[1 << 18];
    cJSON *doc = moe_t_read_file(j, buf, sizeof buf) ? cJSON_Parse(buf) : NULL;
    cJSON *rows = cJSON_GetObjectItem(doc, "rows");
    int n = cJSON_GetArraySize(rows), right = 0;
    for (int i = 0; i < n; i++) {
        cJSON *tk = cJSON_GetObjectItem(cJSON_GetArrayItem(rows, i), "tokens");
        right += cJSON_IsNumber(tk) && tk->valueint == T;
    }
    CHECK(n == 8 && right == n, "rows graded on the file's %lld tokens: %d of %d", (long long)T, right, n);
    cJSON_Delete(doc);
    write_input(in, T, H, hidden, NULL); /* layer 0 is hash-routed: it needs ids */
    snprintf(args, sizeof args, "audit --model %s --input %s --paths act", dir, in);
    CHECK(cli(args) == 1 && strstr(out_buf, "layer 0 is hash-routed and needs tensor input_ids"),
          "hash layer without ids named: %s", out_buf);
    write_input(in, T, 128, hidden, ids);
    snprintf(args, sizeof args, "audit --model %s --input %s --paths act", dir, in);
    CHECK(cli(args) == 1 && strstr(out_buf, "expected [*, 256]"), "wrong H named: %s", out_buf);
    free(hidden);
}

/* The HTML report of a 60-layer model: headline first, one heatmap column
 * per layer, cells and width that stay legible. */
static void test_audit_html_60_layers(void) {
    const char *dir = synth_ckpt("l60", 60, 64, 32, 8, 2);
    const char *html = tmp("a60.html");
    char args[4096];
    /* one thread: the 60 tiny layers are dominated by thread start-up */
    snprintf(args, sizeof args, "OMP_NUM_THREADS=1 '%s' audit --model %s --tokens 8 --paths weights,act.bf16 --quiet --html %s 2>&1",
             MOE_CLI, dir, html);
    CHECK(moe_t_sh(args, out_buf, sizeof out_buf) == 0, "60-layer audit: %s", out_buf);
    static char page[1 << 22];
    if (!moe_t_read_file(html, page, sizeof page)) { CHECK(0, "no HTML"); return; }
    const char *body = strstr(page, "<body>");
    static const char opening[] = "\n<div class=\"headline\"";
    CHECK(body && !strncmp(body + 6, opening, strlen(opening)), "the page opens with the headline");
    CHECK(strstr(page, "Worst shortcut: ") != NULL, "headline names the worst shortcut");
    const char *hm = strstr(page, "Every path on every layer (60 layers");
    CHECK(hm != NULL, "a path x layer heatmap of 60 layers");
    if (!hm) return;
    int width = 0, cw = 0;
    const char *svg = strstr(hm, "<svg");
    if (svg) sscanf(strstr(svg, "width=\"") + 7, "%d", &width);
    const char *rect = svg ? strstr(svg, "<rect x=") : NULL;
    if (rect) sscanf(strstr(rect, "width=\"") + 7, "%d", &cw);
    CHECK(width > 0 && width <= 1100 && cw >= 8, "heatmap %d px wide, cells %d px (at most 1100, at least 8)", width, cw);
    int labelled = 0, cells59 = 0;
    for (int l = 0; l < 60; l++) {
        char lab[64];
        snprintf(lab, sizeof lab, "fill=\"#555\">%d</text>", l);
        labelled += strstr(hm, lab) != NULL;
    }
    for (const char *p = hm; (p = strstr(p, ", layer 59: ")) != NULL; p++) cells59++;
    CHECK(labelled >= 12 && labelled < 60, "layer labels thinned to stay legible: %d of 60", labelled);
    CHECK(cells59 == 8, "one cell per path on the last layer: %d of 8", cells59);
    CHECK(strstr(page, "#ef8f00") && strstr(page, "#2e7d32"), "grade colours");
}

/* #12 item 9: no output replaces an input. Before the fix `run --model C
 * --output C/model.safetensors` overwrote the checkpoint's own shard with
 * the run's outputs (and `audit --json C/config.json` its config). Every
 * case on a copy of dsv4-tiny; each refusal is exit 2 naming both paths, and
 * the input is byte for byte what it was. */
static void test_outputs_never_inputs(void) {
    char dir[1024], args[8192], sh[8192], ref[64 << 10], got[64 << 10];
    moe_t_tmp_path(dir, sizeof dir, "own-ckpt");
    snprintf(sh, sizeof sh, "rm -rf '%s' && cp -r '%s' '%s'", dir, moe_t_data("dsv4-tiny"), dir);
    CHECK(moe_t_sh(sh, out_buf, sizeof out_buf) == 0, "copy of dsv4-tiny: %s", out_buf);
    char cfg[1200], shard[1200];
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    snprintf(shard, sizeof shard, "%s/model.safetensors", dir);
    moe_t_read_file(cfg, ref, sizeof ref);
    const char *in = tmp("own-in.safetensors");
    snprintf(args, sizeof args, "run --model %s --output %s --quiet", dir, in);
    CHECK(cli(args) == 0, "run output: %s", out_buf);
    const char *alias = tmp("own-alias.json");
    remove(alias);
    CHECK(symlink(cfg, alias) == 0, "symlink %s", alias);
    struct { const char *args, *named; } cases[] = {
        {"run --model %s --output %s/model.safetensors", "model.safetensors"},
        {"run --model %s --json %s/config.json --block hc_ffn", "config.json"},
        {"audit --model %s --layers 1 --paths act --json %s/config.json", "config.json"},
        {"audit --model %s --layers 1 --paths act --html %s/model.safetensors", "model.safetensors"},
        {"forward --model %s --output %s/config.json", "config.json"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char a1[4096];
        snprintf(a1, sizeof a1, cases[i].args, dir, dir);
        CHECK(cli(a1) == 2 && strstr(out_buf, "refusing to overwrite an input") && strstr(out_buf, cases[i].named),
              "%s: %s", a1, out_buf);
    }
    snprintf(args, sizeof args, "audit --model %s --layers 1 --paths act --json %s", dir, alias);
    CHECK(cli(args) == 2 && strstr(out_buf, "config.json"), "config.json through a symlink: %s", out_buf);
    snprintf(args, sizeof args, "run --model %s --input %s --output %s", dir, in, in);
    CHECK(cli(args) == 2 && strstr(out_buf, "refusing to overwrite an input"), "--output = --input: %s", out_buf);
    snprintf(args, sizeof args, "diagnose --model %s --dump %s --layer 1 --json %s", dir, in, in);
    CHECK(cli(args) == 2 && strstr(out_buf, "refusing to overwrite an input"), "--json = --dump: %s", out_buf);
    moe_t_read_file(cfg, got, sizeof got);
    CHECK(strcmp(ref, got) == 0, "config.json changed");
    snprintf(sh, sizeof sh, "cmp '%s' '%s'", shard, moe_t_data("dsv4-tiny/model.safetensors"));
    CHECK(moe_t_sh(sh, out_buf, sizeof out_buf) == 0, "the checkpoint's shard changed");
}

/* #12 item 8: a report that cannot be written (here: a file size limit of 0,
 * the kernel's EFBIG, SIGXFSZ ignored; the same path as a full disk) keeps
 * the old report byte for byte, leaves no temporary, exits 1 and names the
 * file and the cause (before: JSON/HTML were written in place, truncated,
 * and `diagnose --json` exited 2 without a message). */
static void test_report_write_fails(void) {
    char dir[1024], sh[16384];
    moe_t_tmp_path(dir, sizeof dir, "report-full");
    snprintf(sh, sizeof sh, "rm -rf '%s' && mkdir '%s' && printf '{\"old\": 1}' > '%s/r.json' && "
             "printf '<p>old</p>' > '%s/r.html'", dir, dir, dir, dir);
    CHECK(moe_t_sh(sh, out_buf, sizeof out_buf) == 0, "setup: %s", out_buf);
    char cmds[3][4096];
    snprintf(cmds[0], sizeof cmds[0], "audit --layers 1 --paths act --json %s/r.json --html %s/r.html", dir, dir);
    snprintf(cmds[1], sizeof cmds[1], "run --block hc_ffn --json %s/r.json", dir);
    snprintf(cmds[2], sizeof cmds[2], "diagnose --model dsv4-tiny --dump %s/engine-dumps/transformers-h200/"
             "dsv4-tiny-fp32-hash_off_by_one.safetensors --all --quiet --json %s/r.json --html %s/r.html",
             MOE_TEST_DATA, dir, dir);
    for (int i = 0; i < 3; i++) {
        const char *c1 = cmds[i];
        snprintf(sh, sizeof sh, "sh -c \"trap '' XFSZ; ulimit -f 0; '%s' %s\" 2>&1", MOE_CLI, c1);
        CHECK(moe_t_sh(sh, out_buf, sizeof out_buf) == 1 && strstr(out_buf, "r.json") &&
                  strstr(out_buf, "File too large"),
              "%s: %s", c1, out_buf);
        char buf[256];
        snprintf(sh, sizeof sh, "%s/r.json", dir);
        CHECK(strcmp(moe_t_read_file(sh, buf, sizeof buf), "{\"old\": 1}") == 0, "old JSON report damaged: %s", buf);
        snprintf(sh, sizeof sh, "%s/r.html", dir);
        CHECK(strcmp(moe_t_read_file(sh, buf, sizeof buf), "<p>old</p>") == 0, "old HTML report damaged: %s", buf);
        CHECK(moe_t_count_temps(dir) == 0, "a temporary left behind in %s", dir);
    }
}

/* #12 item 6: `run` without --layer on a model of 70 MoE layers. Before:
 * 10 or more layers overflowed the writer ("out of memory", nothing
 * written) and past 64 layers the run stopped silently with exit 0. Now the
 * layers stream into one file: all 70 x 7 tensors, each layer's equal to
 * the bytes of `run --layer N` of that layer. */
static void test_run_every_layer_streamed(void) {
    char dir[1024], args[8192];
    moe_t_tmp_path(dir, sizeof dir, "synth-70");
    moe_synth_opts so = moe_synth_opts_default();
    so.hidden = 64;
    so.inter = 32;
    so.n_layers = 70;
    so.n_hash_layers = 1;
    moe_error err;
    CHECK_OK(moe_synth_write(dir, &so, &err), err);
    const char *all = tmp("run-70.safetensors"), *one = tmp("run-70-one.safetensors");
    snprintf(args, sizeof args, "run --model %s --tokens 5 --output %s --quiet", dir, all);
    CHECK(cli(args) == 0, "run over 70 layers: %s", out_buf);
    moe_st_file *f = NULL, *g = NULL;
    CHECK_OK(moe_st_open(all, &f, &err), err);
    CHECK(f && moe_st_count(f) == 70 * 7, "tensors: %zu", f ? moe_st_count(f) : 0);
    const int check[] = {0, 9, 64, 69};
    for (int i = 0; f && i < 4; i++) {
        snprintf(args, sizeof args, "run --model %s --tokens 5 --layer %d --output %s --quiet", dir, check[i], one);
        CHECK(cli(args) == 0, "run --layer %d: %s", check[i], out_buf);
        CHECK_OK(moe_st_open(one, &g, &err), err);
        for (int k = 0; g && k < 7; k++) {
            static const char *const names[] = {"router_logits", "topk_ids", "topk_weights", "eff_weights",
                                                "routed_out", "shared_out", "moe_out"};
            char name[64];
            snprintf(name, sizeof name, "layer%d.%s", check[i], names[k]);
            const moe_st_tensor *a = moe_st_find(f, name), *b = moe_st_find(g, names[k]);
            CHECK(a && b && a->nbytes == b->nbytes && memcmp(a->data, b->data, (size_t)a->nbytes) == 0,
                  "%s differs from run --layer %d", name, check[i]);
        }
        moe_st_close(g);
        g = NULL;
    }
    moe_st_close(f);
}

/* run --block hc_ffn --input: streams [T, hc_mult, H] read by the library's
 * typed reader (what fuzz-hc fuzzes); a wrong shape is exit 2 naming the
 * shape found and the one needed (dsv4-tiny: hc_mult 4, H 96). */
static void test_hc_input(void) {
    double v[3 * 4 * 96];
    uint64_t seed = 5;
    for (int i = 0; i < 3 * 4 * 96; i++) v[i] = moe_t_rng_normal(&seed);
    moe_st_entry e = {"streams", MOE_DTYPE_F64, 3, {3, 4, 96}, v};
    moe_error err;
    const char *good = tmp("hc-streams.safetensors"), *bad = tmp("hc-streams-bad.safetensors");
    CHECK_OK(moe_st_write(good, &e, 1, NULL, &err), err);
    e.shape[1] = 2;
    e.shape[2] = 192;
    CHECK_OK(moe_st_write(bad, &e, 1, NULL, &err), err);
    char args[4096];
    snprintf(args, sizeof args, "run --block hc_ffn --input %s", good);
    CHECK(cli(args) == 0, "hc streams: %s", out_buf);
    snprintf(args, sizeof args, "run --block hc_ffn --input %s", bad);
    CHECK(cli(args) == 2 && strstr(out_buf, "has shape [3, 2, 192]; expected [*, 4, 96]"), "hc wrong shape: %s", out_buf);
}

int main(void) {
    RUN(test_help_and_usage);
    RUN(test_help_every_command);
    RUN(test_option_spellings);
    RUN(test_stdout_outputs);
    RUN(test_bundled_models);
    RUN(test_man_page);
    RUN(test_audit_gate);
    RUN(test_audit_html_60_layers);
    RUN(test_default_run);
    RUN(test_run_files);
    RUN(test_bad_input_files);
    RUN(test_bad_checkpoints);
    RUN(test_outputs_never_inputs);
    RUN(test_hc_input);
    RUN(test_run_every_layer_streamed);
    RUN(test_report_write_fails);
    return moe_t_finish();
}
