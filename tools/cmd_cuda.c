/*
 * moeaudit run/bench --device cuda: the MoE block on an NVIDIA GPU
 * (include/moeaudit_cuda.h). Printing lives here, not in the library.
 */
#include "cmd_cuda.h"
#include "cli.h"
#include "moeaudit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MOE_HAVE_CUDA

int moe_cmd_run_cuda(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "moeaudit: --device cuda: this moeaudit was built without CUDA (nvcc was not found)\n");
    return EXIT_USAGE;
}

int moe_cmd_bench_cuda(int argc, char **argv) { return moe_cmd_run_cuda(argc, argv); }

#else

#include "moeaudit_cuda.h"

#ifndef MOE_DEFAULT_MODEL
#define MOE_DEFAULT_MODEL "tests/data/dsv4-tiny"
#endif
#ifndef MOE_CUDA_PEER_SCRIPT
#define MOE_CUDA_PEER_SCRIPT "bench/cuda/torch_peer.py"
#endif

/* ------------------------------------------------------------------ run */

#define PATHS "auto, gemv, gemv-f32, grouped, mma or wgmma"
static bool parse_path(const char *v, moe_cuda_path *p) {
    static const struct { const char *name; moe_cuda_path path; } t[] = {
        {"auto", MOE_CUDA_PATH_AUTO}, {"gemv", MOE_CUDA_PATH_GEMV},       {"gemv-f32", MOE_CUDA_PATH_GEMV_F32},
        {"grouped", MOE_CUDA_PATH_GROUPED}, {"mma", MOE_CUDA_PATH_MMA}, {"wgmma", MOE_CUDA_PATH_WGMMA}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(v, t[i].name)) {
            *p = t[i].path;
            return true;
        }
    return false;
}

static const char run_help[] =
    "usage: moeaudit run --device cuda [--model DIR] [--layer N] [--input IN.safetensors] [--output OUT.safetensors]\n"
    "                    [--precision bf16|fp8|fp8-f32scale] [--scale-owner router|runner|output] [--fuse-shared]\n"
    "                    [--check] [--compare] [--tokens T] [--path auto|gemv|gemv-f32|grouped|mma|wgmma]\n"
    "\n"
    "Run the MoE block on the GPU: fp32 router, bf16 or FP8 activations into bf16 tensor-core\n"
    "operands, weights decoded on the fly, fp32 accumulation. Outputs as 'moeaudit run' (F32).\n"
    "  --precision P   activations at the expert GEMMs: bf16 (default; 'ref', 'f32' and 'exact'\n"
    "                  mean bf16 here), fp8 (E4M3 per 128, power-of-two scale), fp8-f32scale\n"
    "  --act A         the same as --precision\n"
    "  --compare       also run the CPU float64 reference with the same activation rounding and\n"
    "                  print ||gpu - ref|| / ||ref|| and the tokens routed differently\n"
    "  --path P        expert kernels: auto (default), gemv (small T), grouped (FP4, moderate T),\n"
    "                  wgmma (grouped GEMMs on Hopper's wgmma), mma (the older mma.sync GEMMs)\n";

static double rel_norm(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int moe_cmd_run_cuda(int argc, char **argv) {
    const char *model_dir = MOE_DEFAULT_MODEL, *in_path = NULL, *out_path = NULL;
    long layer = -1, tokens = 8;
    bool compare = false;
    moe_cuda_path path = MOE_CUDA_PATH_AUTO;
    moe_run_opts opts = moe_run_opts_default();
    opts.act = MOE_ACT_BF16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(run_help, stdout); return EXIT_OKAY; }
        else if (!strcmp(a, "--fuse-shared")) opts.fuse_shared = true;
        else if (!strcmp(a, "--check")) opts.check_invariants = true;
        else if (!strcmp(a, "--compare")) compare = true;
        else if (!has_val && !strncmp(a, "--", 2)) return moe_cli_usage("run", "option %s needs a value", a);
        else if (!strcmp(a, "--device")) {
            if (strcmp(argv[++i], "cuda")) return moe_cli_usage("run", "--device %s: this command runs cuda", argv[i]);
        } else if (!strcmp(a, "--model")) model_dir = argv[++i];
        else if (!strcmp(a, "--block")) {
            if (strcmp(argv[++i], "moe")) return moe_cli_usage("run", "--block %s: the GPU runs the moe block only", argv[i]);
        } else if (!strcmp(a, "--input")) in_path = argv[++i];
        else if (!strcmp(a, "--output")) out_path = argv[++i];
        else if (!strcmp(a, "--layer")) {
            if (!moe_cli_parse_int(argv[++i], 0, 1000000, &layer)) return moe_cli_usage("run", "--layer %s: not a layer index", argv[i]);
        } else if (!strcmp(a, "--tokens")) {
            if (!moe_cli_parse_int(argv[++i], 1, 1 << 24, &tokens)) return moe_cli_usage("run", "--tokens %s: not a positive count", argv[i]);
        } else if (!strcmp(a, "--precision") || !strcmp(a, "--act")) {
            const char *p = argv[++i];
            if (!strcmp(p, "ref") || !strcmp(p, "f32") || !strcmp(p, "exact") || !strcmp(p, "bf16")) opts.act = MOE_ACT_BF16;
            else if (!moe_act_prec_parse(p, &opts.act))
                return moe_cli_usage("run", "--precision %s: expected bf16, fp8 or fp8-f32scale on the GPU", p);
        } else if (!strcmp(a, "--scale-owner")) {
            if (!moe_scale_owner_parse(argv[++i], &opts.owner))
                return moe_cli_usage("run", "--scale-owner %s: expected router, runner or output", argv[i]);
        } else if (!strcmp(a, "--path")) {
            const char *p = argv[++i];
            if (!parse_path(p, &path)) return moe_cli_usage("run", "--path %s: expected " PATHS, p);
        } else return moe_cli_usage("run", "unknown argument %s", a);
    }
    if (opts.fuse_shared && opts.owner == MOE_SCALE_OUTPUT)
        return moe_cli_usage("run", "%s", "--fuse-shared cannot be used with --scale-owner output");
    moe_error err;
    char dev[256];
    moe_status st = moe_cuda_device_info(dev, sizeof dev, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    moe_model *m = NULL;
    st = moe_model_open(model_dir, &m, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    const moe_model_info *info = moe_model_get_info(m);
    moe_cli_input in = {0};
    int rc = in_path ? moe_cli_read_input(in_path, info->hidden, &in)
                     : moe_cli_builtin_input(&in, tokens, info->hidden, info->vocab);
    if (rc != EXIT_OKAY) { moe_model_free(m); return rc; }
    double *hidden = in.hidden;
    int64_t *ids = in.ids, T = in.T;
    printf("model %s (%s), %lld tokens on %s, activations %s\n", model_dir, info->model_type, (long long)T, dev,
           moe_act_prec_name(opts.act));
    int first = layer >= 0 ? (int)layer : 0, last = layer >= 0 ? (int)layer : info->n_layers - 1;
    moe_cli_writer w = {.n = 0};
    moe_block_out outs[16];
    int nout = 0;
    for (int li = first; li <= last && rc == EXIT_OKAY && nout < 16; li++) {
        moe_layer_kind kind;
        st = moe_model_layer_kind(m, li, &kind, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        if (kind == MOE_LAYER_DENSE) {
            if (layer >= 0) { fprintf(stderr, "moeaudit: layer %d is dense\n", li); rc = EXIT_USAGE; }
            continue;
        }
        const moe_layer *L = NULL;
        if ((st = moe_model_layer(m, li, &L, &err)) != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        moe_cuda_layer *g = NULL;
        if ((st = moe_cuda_layer_upload(L, &g, &err)) != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        moe_cuda_layer_set_path(g, path);
        moe_block_out *o = &outs[nout];
        if ((st = moe_block_out_init(o, L, T, &opts, &err)) != MOE_OK) { moe_cuda_layer_free(g); rc = moe_cli_fail(st, &err); break; }
        nout++;
        st = moe_cuda_block_run(g, hidden, ids, T, &opts, o, &err);
        moe_cuda_layer_free(g);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        double ws = 0;
        for (int j = 0; j < L->cfg.top_k; j++) ws += o->eff_weights[j];
        printf("layer %d: E=%d K=%d; first token's experts:", li, L->cfg.n_experts, L->cfg.top_k);
        for (int j = 0; j < o->n_cols; j++) printf(" %d (w %.4f)", o->topk_ids[j], o->topk_weights[j]);
        printf("; effective routed weight sum %.6f (s = %g)\n", ws, L->cfg.scaling);
        if (opts.check_invariants) printf("  contract check: ok\n");
        if (compare) {
            moe_block_out ref;
            moe_run_opts ro = opts;
            ro.check_invariants = false;
            ro.precision = MOE_PREC_REF;
            if ((st = moe_block_out_init(&ref, L, T, &ro, &err)) != MOE_OK ||
                (st = moe_block_run(L, hidden, ids, T, &ro, &ref, &err)) != MOE_OK) {
                rc = moe_cli_fail(st, &err);
                break;
            }
            int64_t flips = 0;
            for (int64_t t = 0; t < T; t++)
                for (int j = 0; j < L->cfg.top_k; j++) {
                    bool f = false;
                    for (int q = 0; q < L->cfg.top_k; q++) f |= ref.topk_ids[t * o->n_cols + j] == o->topk_ids[t * o->n_cols + q];
                    if (!f) { flips++; break; }
                }
            printf("  vs CPU float64 reference (same activation rounding): moe_out rel %.3e, routed %.3e, "
                   "shared %.3e, tokens routed differently %lld\n",
                   rel_norm(o->moe_out, ref.moe_out, T * o->H), rel_norm(o->routed_out, ref.routed_out, T * o->H),
                   rel_norm(o->shared_out, ref.shared_out, T * o->H), (long long)flips);
            moe_block_out_free(&ref);
        }
        if (out_path) {
            char prefix[32] = "";
            if (layer < 0) snprintf(prefix, sizeof prefix, "layer%d.", li);
            if (moe_cli_writer_add_block(&w, prefix, o, true)) { fprintf(stderr, "moeaudit: out of memory\n"); rc = EXIT_FAIL; }
        }
    }
    rc = moe_cli_writer_finish(&w, out_path, rc);
    for (int i = 0; i < nout; i++) moe_block_out_free(&outs[i]);
    moe_cli_input_free(&in);
    moe_model_free(m);
    return rc;
}

/* ---------------------------------------------------------------- bench */

static const char bench_help[] =
    "usage: moeaudit bench --device cuda [--shape v4flash|v3] [--weights LIST] [--act LIST] [--tokens LIST]\n"
    "                      [--iters N] [--path auto|gemv|gemv-f32|grouped|mma|wgmma] [--json FILE] [--no-peer] [--no-graphs]\n"
    "\n"
    "Time the routed experts on the GPU (sort by expert, gate/up + SwiGLU, down + weighted combine)\n"
    "with fresh expert ids drawn over all E experts (8 sets, rotated), beside floors measured in the\n"
    "same run: memory floor = bytes of the touched experts' weights (stored size, scales included)\n"
    "+ activations, over the device copy bandwidth (read + write); compute floor = 2 T K 3 H I over\n"
    "the dense bf16 cuBLAS GEMM rate. The peer is torch._grouped_mm in bf16 (bench/cuda/torch_peer.py),\n"
    "run after our rows when python3 can import torch.\n"
    "  --weights L   comma list of mxfp4, nvfp4, fp8, bf16 (default mxfp4,bf16)\n"
    "  --act L       comma list of bf16, fp8 (default bf16)\n"
    "  --tokens L    default 1,16,128,1024,4096,8192\n"
    "  --no-graphs   launch each iteration's kernels directly (default: replay one CUDA graph per\n"
    "                routing set, so host launch gaps stay out of the device time)\n";

typedef struct gshape { const char *name; int H, I, E, K; } gshape;
static const gshape gshapes[] = {{"v4flash", 4096, 2048, 256, 6}, {"v3", 7168, 2048, 256, 8}};

static double expert_bytes(moe_wfmt f, double H, double I) {
    double n = 3 * H * I;
    switch (f) {
    case MOE_WFMT_MXFP4: return n / 2 + n / 32;
    case MOE_WFMT_NVFP4: return n / 2 + n / 16;
    case MOE_WFMT_FP8_BLOCK: return n + 3 * ceil(H / 128) * ceil(I / 128) * 4;
    default: return 2 * n;
    }
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int parse_list(const char *s, long *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v <= 0) return -1;
        out[n++] = v;
        if (*end && *end != ',') return -1;
        s = *end ? end + 1 : end;
    }
    return n;
}

typedef struct brow {
    const char *weights, *act;
    long T;
    double median, p90, memf, compf, peer;
} brow;

int moe_cmd_bench_cuda(int argc, char **argv) {
    const char *shape_name = "v4flash", *weights = "mxfp4,bf16", *acts = "bf16", *json = NULL;
    long tokens[16] = {1, 16, 128, 1024, 4096, 8192};
    int ntok = 6, iters = 0;
    bool peer = true, graphs = true;
    moe_cuda_path path = MOE_CUDA_PATH_AUTO;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(bench_help, stdout); return 0; }
        if (!strcmp(a, "--no-peer")) { peer = false; continue; }
        if (!strcmp(a, "--no-graphs")) { graphs = false; continue; }
        if (!v) return moe_cli_usage("bench", "option %s needs a value", a);
        i++;
        if (!strcmp(a, "--device")) { if (strcmp(v, "cuda")) return moe_cli_usage("bench", "--device %s: expected cuda", v); }
        else if (!strcmp(a, "--shape")) shape_name = v;
        else if (!strcmp(a, "--weights")) weights = v;
        else if (!strcmp(a, "--act")) acts = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--iters")) iters = atoi(v);
        else if (!strcmp(a, "--path")) {
            if (!parse_path(v, &path)) return moe_cli_usage("bench", "--path %s: expected " PATHS, v);
        }
        else if (!strcmp(a, "--tokens")) {
            if ((ntok = parse_list(v, tokens, 16)) <= 0) return moe_cli_usage("bench", "--tokens %s: expected a comma list", v);
        } else return moe_cli_usage("bench", "unknown option %s", a);
    }
    const gshape *s = NULL;
    for (size_t i = 0; i < sizeof gshapes / sizeof gshapes[0]; i++)
        if (!strcmp(gshapes[i].name, shape_name)) s = &gshapes[i];
    if (!s) return moe_cli_usage("bench", "--shape %s: expected v4flash or v3", shape_name);
    moe_error err;
    char dev[256];
    moe_status st = moe_cuda_device_info(dev, sizeof dev, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    double bw = 0, peak = 0;
    printf("device %s\nmeasuring ceilings: device copy 2 GiB, cuBLAS bf16 GEMM 8192^3 ...\n", dev);
    fflush(stdout);
    st = moe_cuda_measure_ceilings(&bw, &peak, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    double peak8 = 0;
    st = moe_cuda_measure_fp8_peak(&peak8, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    printf("copy bandwidth %.0f GB/s (read + write), dense bf16 %.1f TFLOP/s, dense fp8 %.1f TFLOP/s (cuBLASLt)\n"
           "(every path here multiplies bf16 operands on the tensor cores, FP8 activations included: the bf16\n"
           "rate is the peak of the precision used and sets the compute floor)\n\n",
           bw * 1e-9, peak * 1e-12, peak8 * 1e-12);
    brow rows[128];
    int nrows = 0;
    const int n_sets = 8;
    char wl[128];
    snprintf(wl, sizeof wl, "%s", weights);
    for (char *sv = NULL, *wn = strtok_r(wl, ",", &sv); wn; wn = strtok_r(NULL, ",", &sv)) {
        moe_wfmt f;
        const char *wname;
        if (!strcmp(wn, "mxfp4")) { f = MOE_WFMT_MXFP4; wname = "mxfp4"; }
        else if (!strcmp(wn, "nvfp4")) { f = MOE_WFMT_NVFP4; wname = "nvfp4"; }
        else if (!strcmp(wn, "fp8")) { f = MOE_WFMT_FP8_BLOCK; wname = "fp8"; }
        else if (!strcmp(wn, "bf16")) { f = MOE_WFMT_BF16; wname = "bf16"; }
        else return moe_cli_usage("bench", "--weights %s: expected mxfp4, nvfp4, fp8 or bf16", wn);
        moe_cuda_layer *g = NULL;
        st = moe_cuda_layer_random(f, s->H, s->I, s->E, s->K, 7, &g, &err);
        if (st != MOE_OK) return moe_cli_fail(st, &err);
        moe_cuda_layer_set_path(g, path);
        double eb = expert_bytes(f, s->H, s->I);
        printf("%s %s: %d experts x %.1f MiB = %.2f GiB on the device\n", s->name, wname, s->E, eb / (1 << 20),
               eb * s->E / (double)(1u << 30));
        char al[64];
        snprintf(al, sizeof al, "%s", acts);
        for (char *sa = NULL, *an = strtok_r(al, ",", &sa); an; an = strtok_r(NULL, ",", &sa)) {
            moe_act_prec act = !strcmp(an, "fp8") ? MOE_ACT_FP8 : MOE_ACT_BF16;
            for (int ti = 0; ti < ntok && nrows < 128; ti++) {
                long T = tokens[ti];
                int it = iters > 0 ? iters : T <= 16 ? 200 : T <= 1024 ? 40 : 12;
                size_t n = (size_t)n_sets * (size_t)T * (size_t)s->K;
                int32_t *ids = malloc(n * 4);
                float *w = malloc(n * 4);
                double *times = malloc(sizeof(double) * (size_t)it), memf[8];
                if (!ids || !w || !times) { fprintf(stderr, "bench: out of memory\n"); return EXIT_FAIL; }
                uint64_t rs = 1234 + (uint64_t)T;
                char *touched = calloc((size_t)s->E, 1);
                for (int set = 0; set < n_sets; set++) {
                    memset(touched, 0, (size_t)s->E);
                    int nt = 0;
                    for (long t = 0; t < T; t++) {
                        int32_t *row = ids + ((size_t)set * T + t) * s->K;
                        for (int j = 0; j < s->K; j++) {
                            int32_t e;
                            bool dup;
                            do {
                                e = (int32_t)(moe_cli_mix(&rs) % (uint64_t)s->E);
                                dup = false;
                                for (int q = 0; q < j; q++) dup |= row[q] == e;
                            } while (dup);
                            row[j] = e;
                            w[((size_t)set * T + t) * s->K + j] = 1.0f / (float)s->K;
                            if (!touched[e]) { touched[e] = 1; nt++; }
                        }
                    }
                    double bytes = nt * eb + (double)T * s->H * 2 + (double)T * s->H * 4;
                    memf[set] = bytes / bw * 1e3;
                }
                free(touched);
                st = moe_cuda_bench_experts(g, T, act, ids, w, n_sets, 5, it, graphs, times, &err);
                free(ids);
                free(w);
                if (st != MOE_OK) { moe_cuda_layer_free(g); free(times); return moe_cli_fail(st, &err); }
                qsort(times, (size_t)it, sizeof *times, cmp_d);
                qsort(memf, n_sets, sizeof *memf, cmp_d);
                brow *r = &rows[nrows++];
                r->weights = wname;
                r->act = act == MOE_ACT_FP8 ? "fp8" : "bf16";
                r->T = T;
                r->median = times[it / 2];
                r->p90 = times[(int)ceil(0.9 * it) - 1];
                r->memf = memf[n_sets / 2];
                r->compf = peak > 0 ? 2.0 * T * s->K * 3.0 * s->H * (double)s->I / peak * 1e3 : 0;
                r->peer = -1;
                double fl = fmax(r->memf, r->compf);
                printf("  %s act=%s T=%-5ld median %8.4f ms  p90 %8.4f  mem floor %8.4f  compute floor %8.4f  "
                       "ratio %5.2f  (%.0f TFLOP/s)\n",
                       wname, r->act, T, r->median, r->p90, r->memf, r->compf, r->median / fl,
                       2.0 * T * s->K * 3.0 * s->H * (double)s->I / (r->median * 1e-3) * 1e-12);
                fflush(stdout);
                free(times);
            }
        }
        moe_cuda_layer_free(g);
    }
    if (peer) {
        char cmd[1024], tl[256] = "";
        for (int i = 0; i < ntok; i++) {
            char b[32];
            snprintf(b, sizeof b, "%s%ld", i ? "," : "", tokens[i]);
            strncat(tl, b, sizeof tl - strlen(tl) - 1);
        }
        snprintf(cmd, sizeof cmd, "python3 %s --shape %s --tokens %s 2>&1", MOE_CUDA_PEER_SCRIPT, s->name, tl);
        printf("\npeer: %s\n", cmd);
        fflush(stdout);
        FILE *p = popen(cmd, "r");
        char line[512];
        while (p && fgets(line, sizeof line, p)) {
            fputs(line, stdout);
            long T;
            double med;
            if (sscanf(line, "PEER tokens=%ld median_ms=%lf", &T, &med) == 2)
                for (int i = 0; i < nrows; i++)
                    if (rows[i].T == T) rows[i].peer = med;
        }
        if (p) pclose(p);
    }
    printf("\n| shape | weights | act | T | median ms | p90 ms | memory floor ms | compute floor ms | time / max(floors) | "
           "TFLOP/s | %% of bf16 peak | torch bf16 _grouped_mm ms | speed-up |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nrows; i++) {
        brow *r = &rows[i];
        double fl = fmax(r->memf, r->compf);
        char pm[32] = "-", su[32] = "-";
        if (r->peer > 0) {
            snprintf(pm, sizeof pm, "%.4f", r->peer);
            snprintf(su, sizeof su, "%.2fx", r->peer / r->median);
        }
        double tf = 2.0 * r->T * s->K * 3.0 * s->H * (double)s->I / (r->median * 1e-3);
        printf("| %s | %s | %s | %ld | %.4f | %.4f | %.4f | %.4f | %.2f | %.0f | %.1f | %s | %s |\n", s->name, r->weights,
               r->act, r->T, r->median, r->p90, r->memf, r->compf, r->median / fl, tf * 1e-12,
               peak > 0 ? 100.0 * tf / peak : 0.0, pm, su);
    }
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) { fprintf(stderr, "bench: cannot write %s\n", json); return EXIT_FAIL; }
        fprintf(f,
                "{\n  \"device\": \"%s\",\n  \"copy_bandwidth_gbs\": %.3f,\n  \"bf16_peak_tflops\": %.3f,\n"
                "  \"fp8_peak_tflops\": %.3f,\n  \"operand_precision\": \"bf16\",\n  \"rows\": [\n",
                dev, bw * 1e-9, peak * 1e-12, peak8 * 1e-12);
        for (int i = 0; i < nrows; i++) {
            brow *r = &rows[i];
            fprintf(f,
                    "    {\"shape\": \"%s\", \"weights\": \"%s\", \"activations\": \"%s\", \"tokens\": %ld, "
                    "\"median_ms\": %.5f, \"p90_ms\": %.5f, \"memory_floor_ms\": %.5f, \"compute_floor_ms\": %.5f, "
                    "\"threads\": 0, \"isa\": \"cuda-sm_90a\", \"peer_torch_grouped_mm_ms\": %.5f}%s\n",
                    s->name, r->weights, r->act, r->T, r->median, r->p90, r->memf, r->compf, r->peer,
                    i + 1 < nrows ? "," : "");
        }
        fprintf(f, "  ]\n}\n");
        fclose(f);
    }
    return 0;
}

#endif /* MOE_HAVE_CUDA */
