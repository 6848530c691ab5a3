/*
 * moeaudit run/bench --device cuda: the MoE block on an NVIDIA GPU
 * (include/moeaudit_cuda.h). Printing lives here, not in the library.
 */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef MOE_HAVE_CUDA

static int no_cuda(void) {
    fprintf(stderr, "moeaudit: --device cuda: this moeaudit was built without CUDA (nvcc was not found)\n");
    return EXIT_USAGE;
}

int moe_run_cuda(const moe_cli_run_args *a) { (void)a; return no_cuda(); }
int moe_bench_cuda(const moe_cli_bench_args *a) { (void)a; return no_cuda(); }

#else

#include "moeaudit_cuda.h"

#ifndef MOE_CUDA_PEER_SCRIPT
#define MOE_CUDA_PEER_SCRIPT "bench/cuda/torch_peer.py"
#endif

/* ------------------------------------------------------------------ run */

static double rel_norm(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static const moe_cuda_path gpaths[] = {MOE_CUDA_PATH_AUTO, MOE_CUDA_PATH_GEMV, MOE_CUDA_PATH_GEMV_F32,
                                       MOE_CUDA_PATH_GROUPED, MOE_CUDA_PATH_MMA, MOE_CUDA_PATH_WGMMA,
                                       MOE_CUDA_PATH_WGMMA_CP, MOE_CUDA_PATH_WGMMA_PD, MOE_CUDA_PATH_WGMMA_BF16};

/* MOE_CUDA_SMALLT_LAUNCH (docs/guide.md): how the small-T GEMV chain is
 * launched (moe_cuda_layer_set_smallt_launch): pdl (unset: the default),
 * pdl-l2, l2, or plain (the earlier stream-ordered launches, for the A/B).
 * *name: the value in effect. 0, or the usage error's exit code. */
static int smallt_launch(const char *cmd, unsigned *flags, const char **name) {
    static const struct { const char *name; unsigned flags; } v[] = {
        {"pdl", MOE_CUDA_SMALLT_PDL}, {"pdl-l2", MOE_CUDA_SMALLT_PDL | MOE_CUDA_SMALLT_L2},
        {"l2", MOE_CUDA_SMALLT_L2}, {"plain", 0}};
    const char *e = getenv("MOE_CUDA_SMALLT_LAUNCH");
    *flags = v[0].flags;
    *name = v[0].name;
    if (!e || !*e) return 0;
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        if (!strcmp(e, v[i].name)) {
            *flags = v[i].flags;
            *name = v[i].name;
            return 0;
        }
    return moe_cli_usage(cmd, "MOE_CUDA_SMALLT_LAUNCH=%s: expected pdl, pdl-l2, l2 or plain", e);
}

/* MOE_CUDA_WG_TOKENS (docs/guide.md): 128 or 256 token rows per tile of
 * the bf16-operand wgmma GEMMs (moe_cuda_layer_set_wg_tokens), unset or
 * "auto": the library's rule. 0, or the usage error's exit code. */
static int wg_tokens(const char *cmd, int *tokens) {
    const char *e = getenv("MOE_CUDA_WG_TOKENS");
    *tokens = 0;
    if (!e || !*e || !strcmp(e, "auto")) return 0;
    if (!strcmp(e, "128") || !strcmp(e, "256")) {
        *tokens = atoi(e);
        return 0;
    }
    return moe_cli_usage(cmd, "MOE_CUDA_WG_TOKENS=%s: expected auto, 128 or 256", e);
}

int moe_run_cuda(const moe_cli_run_args *a) {
    const char *model_dir = a->model, *in_path = a->c.input, *out_path = a->c.output;
    long layer = a->c.layer, tokens = a->tokens;
    bool compare = a->compare;
    moe_cuda_path path = gpaths[a->gpath];
    unsigned launch;
    const char *launch_name;
    int urc = smallt_launch("run", &launch, &launch_name), wgt = 0;
    if (urc) return urc;
    if ((urc = wg_tokens("run", &wgt))) return urc;
    const moe_run_opts *opts = &a->o;
    FILE *text = moe_cli_text(a->c.quiet, out_path && !strcmp(out_path, "-"));
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
    if (text)
        fprintf(text, "model %s (%s), %lld tokens on %s, activations %s\n", model_dir, info->model_type, (long long)T,
                dev, moe_act_prec_name(opts->act));
    int first = layer >= 0 ? (int)layer : 0, last = layer >= 0 ? (int)layer : info->n_layers - 1;
    moe_cli_writer w = {.n = 0};
    moe_block_out outs[16];
    int nout = 0;
    for (int li = first; li <= last && rc == EXIT_OKAY && nout < 16; li++) {
        moe_layer_kind kind;
        st = moe_model_layer_kind(m, li, &kind, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        if (kind == MOE_LAYER_DENSE) {
            if (layer >= 0) { fprintf(stderr, "moeaudit: layer %d is dense: it has no MoE block\n", li); rc = EXIT_USAGE; }
            continue;
        }
        const moe_layer *L = NULL;
        if ((st = moe_model_layer(m, li, &L, &err)) != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        moe_cuda_layer *g = NULL;
        if ((st = moe_cuda_layer_upload(L, &g, &err)) != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        moe_cuda_layer_set_path(g, path);
        moe_cuda_layer_set_smallt_launch(g, launch);
        moe_cuda_layer_set_wg_tokens(g, wgt);
        moe_block_out *o = &outs[nout];
        if ((st = moe_block_out_init(o, L, T, opts, &err)) != MOE_OK) { moe_cuda_layer_free(g); rc = moe_cli_fail(st, &err); break; }
        nout++;
        st = moe_cuda_block_run(g, hidden, ids, T, opts, o, &err);
        moe_cuda_layer_free(g);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        double ws = 0;
        for (int j = 0; j < L->cfg.top_k; j++) ws += o->eff_weights[j];
        if (text) {
            fprintf(text, "layer %d: E=%d K=%d; first token's experts:", li, L->cfg.n_experts, L->cfg.top_k);
            for (int j = 0; j < o->n_cols; j++) fprintf(text, " %d (w %.4f)", o->topk_ids[j], o->topk_weights[j]);
            fprintf(text, "; effective routed weight sum %.6f (s = %g)\n", ws, L->cfg.scaling);
            if (opts->check_invariants) fprintf(text, "  contract check: ok\n");
        }
        if (compare) {
            moe_block_out ref;
            moe_run_opts ro = *opts;
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
            fprintf(text ? text : stderr, "  vs CPU float64 reference (same activation rounding): moe_out rel %.3e, "
                   "routed %.3e, shared %.3e, tokens routed differently %lld\n",
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
    rc = moe_cli_writer_finish(&w, out_path, rc, a->c.quiet);
    for (int i = 0; i < nout; i++) moe_block_out_free(&outs[i]);
    moe_cli_input_free(&in);
    moe_model_free(m);
    return rc;
}

/* ---------------------------------------------------------------- bench */

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

/* A row's operands as the report's schema names them: "fp8 (mxfp4
 * transcoded)" multiplies E4M3 codes, "fp8". */
static const char *json_ops(const char *ops) { return strncmp(ops, "fp8", 3) ? "bf16" : "fp8"; }

typedef struct brow {
    const char *weights, *act, *ops; /* ops: what the tensor cores multiply (moe_cuda_layer_operands) */
    long T;
    double median, p90, memf, compf, peer, peak; /* peak: the ops' measured rate */
} brow;

int moe_bench_cuda(const moe_cli_bench_args *a) {
    const char *shape_name = a->shape ? a->shape : "v4flash", *weights = a->weights ? a->weights : "mxfp4,bf16",
               *acts = a->acts ? a->acts : "bf16", *json = a->c.json;
    static const long default_tokens[] = {1, 16, 128, 1024, 4096, 8192};
    long tokens[16];
    int ntok = a->ntok > 0 ? a->ntok : 6, iters = (int)a->iters;
    for (int i = 0; i < ntok; i++) tokens[i] = a->ntok > 0 ? (long)a->tok[i] : default_tokens[i];
    bool peer = !a->no_peer, graphs = !a->no_graphs;
    moe_cuda_path path = gpaths[a->gpath];
    unsigned launch;
    const char *launch_name;
    int urc = smallt_launch("bench", &launch, &launch_name), wgt = 0;
    if (urc) return urc;
    if ((urc = wg_tokens("bench", &wgt))) return urc;
    FILE *text = json && !strcmp(json, "-") ? stderr : stdout;
    const gshape *s = NULL;
    for (size_t i = 0; i < sizeof gshapes / sizeof gshapes[0]; i++)
        if (!strcmp(gshapes[i].name, shape_name)) s = &gshapes[i];
    if (!s) return moe_cli_usage("bench", "--shape %s: expected v4flash or v3", shape_name);
    moe_error err;
    char dev[256];
    moe_status st = moe_cuda_device_info(dev, sizeof dev, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    double bw = 0, peak = 0;
    fprintf(text, "device %s\nsmall-T launch %s (MOE_CUDA_SMALLT_LAUNCH); bf16-operand wgmma tile %s tokens "
                  "(MOE_CUDA_WG_TOKENS)\n"
                  "measuring ceilings: device copy 2 GiB, cuBLAS bf16 GEMM 8192^3 ...\n", dev, launch_name,
            wgt == 128 ? "128" : wgt == 256 ? "256" : "auto (256 from 128 positions per expert)");
    fflush(text);
    st = moe_cuda_measure_ceilings(&bw, &peak, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    double peak8 = 0;
    st = moe_cuda_measure_fp8_peak(&peak8, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    fprintf(text, "copy bandwidth %.0f GB/s (read + write), dense bf16 %.1f TFLOP/s, dense fp8 %.1f TFLOP/s (cuBLASLt)\n"
                  "(a row's compute floor and %% of peak use the rate of the operands its tensor cores multiply:\n"
                  "fp8 for FP8 (or transcoded MXFP4) weights with FP8 activations on the FP8 tensor-core GEMMs, bf16 otherwise)\n\n",
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
        moe_cuda_layer_set_smallt_launch(g, launch);
        moe_cuda_layer_set_wg_tokens(g, wgt);
        double eb = expert_bytes(f, s->H, s->I);
        fprintf(text, "%s %s: %d experts x %.1f MiB = %.2f GiB on the device\n", s->name, wname, s->E, eb / (1 << 20),
               eb * s->E / (double)(1u << 30));
        if (moe_cuda_layer_note(g)) fprintf(text, "  %s\n", moe_cuda_layer_note(g));
        char al[64];
        snprintf(al, sizeof al, "%s", acts);
        for (char *sa = NULL, *an = strtok_r(al, ",", &sa); an; an = strtok_r(NULL, ",", &sa)) {
            const moe_cli_prec *ap = moe_cli_prec_find(an, MOE_PU_GPU_ACT);
            if (!ap || !strcmp(ap->name, "fp8-f32scale")) {
                moe_cuda_layer_free(g);
                return moe_cli_usage("bench", "--act %s: expected bf16 or fp8 on the GPU", an);
            }
            moe_act_prec act = !strcmp(ap->name, "fp8") ? MOE_ACT_FP8 : MOE_ACT_BF16;
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
                r->ops = moe_cuda_layer_operands(g, T, act);
                r->peak = !strncmp(r->ops, "fp8", 3) && peak8 > 0 ? peak8 : peak;
                r->T = T;
                r->median = times[it / 2];
                r->p90 = times[(int)ceil(0.9 * it) - 1];
                r->memf = memf[n_sets / 2];
                r->compf = r->peak > 0 ? 2.0 * T * s->K * 3.0 * s->H * (double)s->I / r->peak * 1e3 : 0;
                r->peer = -1;
                double fl = fmax(r->memf, r->compf);
                fprintf(text, "  %s act=%s T=%-5ld median %8.4f ms  p90 %8.4f  mem floor %8.4f  compute floor %8.4f  "
                       "ratio %5.2f  (%.0f TFLOP/s, %s operands)\n",
                       wname, r->act, T, r->median, r->p90, r->memf, r->compf, r->median / fl,
                       2.0 * T * s->K * 3.0 * s->H * (double)s->I / (r->median * 1e-3) * 1e-12, r->ops);
                fflush(text);
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
        /* the script: $MOEAUDIT_TORCH_PEER, else the source tree's copy the
         * build was configured from (an installed binary has no other) */
        const char *script = getenv("MOEAUDIT_TORCH_PEER");
        if (!script || !*script) script = MOE_CUDA_PEER_SCRIPT;
        FILE *p = NULL;
        if (access(script, R_OK) != 0 || strchr(script, '\'')) {
            fprintf(text, "\npeer: %s is not a readable script (set MOEAUDIT_TORCH_PEER to bench/cuda/torch_peer.py, "
                    "or --no-peer): no torch column\n", script);
        } else {
            snprintf(cmd, sizeof cmd, "python3 '%s' --shape %s --tokens %s 2>&1", script, s->name, tl);
            fprintf(text, "\npeer: %s\n", cmd);
            fflush(text);
            p = popen(cmd, "r");
        }
        char line[512];
        while (p && fgets(line, sizeof line, p)) {
            fputs(line, text);
            long T;
            double med;
            if (sscanf(line, "PEER tokens=%ld median_ms=%lf", &T, &med) == 2)
                for (int i = 0; i < nrows; i++)
                    if (rows[i].T == T) rows[i].peer = med;
        }
        if (p) pclose(p);
    }
    fprintf(text, "\n| shape | weights | act | T | median ms | p90 ms | memory floor ms | compute floor ms | time / max(floors) | "
           "TFLOP/s | operands | %% of their peak | torch bf16 _grouped_mm ms | speed-up |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nrows; i++) {
        brow *r = &rows[i];
        double fl = fmax(r->memf, r->compf);
        char pm[32] = "-", su[32] = "-";
        if (r->peer > 0) {
            snprintf(pm, sizeof pm, "%.4f", r->peer);
            snprintf(su, sizeof su, "%.2fx", r->peer / r->median);
        }
        double tf = 2.0 * r->T * s->K * 3.0 * s->H * (double)s->I / (r->median * 1e-3);
        fprintf(text, "| %s | %s | %s | %ld | %.4f | %.4f | %.4f | %.4f | %.2f | %.0f | %s | %.1f | %s | %s |\n", s->name,
                r->weights, r->act, r->T, r->median, r->p90, r->memf, r->compf, r->median / fl, tf * 1e-12, r->ops,
                r->peak > 0 ? 100.0 * tf / r->peak : 0.0, pm, su);
    }
    if (json) {
        /* the report's operands: one kind for every row, or "mixed" */
        const char *all_ops = nrows ? json_ops(rows[0].ops) : "bf16";
        for (int i = 1; i < nrows; i++)
            if (strcmp(json_ops(rows[i].ops), all_ops)) all_ops = "mixed";
        moe_out_file *h = NULL;
        FILE *f = moe_cli_open_out(json, &h);
        if (!f) return EXIT_FAIL;
        fprintf(f,
                "{\n  \"schema_version\": %d,\n  \"tool\": \"%s\",\n  \"report\": \"bench-cuda\",\n  \"device\": \"%s\",\n"
                "  \"copy_bandwidth_gbs\": %.3f,\n  \"bf16_peak_tflops\": %.3f,\n  \"fp8_peak_tflops\": %.3f,\n"
                "  \"operand_precision\": \"%s\",\n  \"rows\": [\n",
                MOE_CLI_SCHEMA_VERSION, MOE_CLI_TOOL, dev, bw * 1e-9, peak * 1e-12, peak8 * 1e-12, all_ops);
        for (int i = 0; i < nrows; i++) {
            brow *r = &rows[i];
            fprintf(f,
                    "    {\"shape\": \"%s\", \"weights\": \"%s\", \"activations\": \"%s\", \"tokens\": %ld, "
                    "\"median_ms\": %.5f, \"p90_ms\": %.5f, \"memory_floor_ms\": %.5f, \"compute_floor_ms\": %.5f, "
                    "\"threads\": 0, \"isa\": \"cuda-sm_90a\", \"peer_torch_grouped_mm_ms\": %.5f, "
                    "\"operand_precision\": \"%s\"}%s\n",
                    s->name, r->weights, r->act, r->T, r->median, r->p90, r->memf, r->compf, r->peer, json_ops(r->ops),
                    i + 1 < nrows ? "," : "");
        }
        fprintf(f, "  ]\n}\n");
        if (!moe_cli_close_out(f, h, json)) return EXIT_FAIL;
    }
    return 0;
}

#endif /* MOE_HAVE_CUDA */
