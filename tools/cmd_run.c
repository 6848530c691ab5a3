/*
 * moeaudit run: one option table for every way of running a block (the CPU
 * MoE block, --device cuda, --ep N under mpirun, --block hc_ffn|hc_attn),
 * parsed once here; the mode's implementation gets the parsed arguments
 * (moe_run_cpu below, moe_run_cuda in cmd_cuda.c, moe_run_ep in cmd_ep.c,
 * moe_run_hc in cmd_hc.c). An option that does not apply to the mode run is
 * refused, never ignored; so is a precision the mode would not compute
 * (--precision ref on the GPU).
 */
#include "cli.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define M_CPU (1u << MOE_RUN_CPU)
#define M_CUDA (1u << MOE_RUN_CUDA)
#define M_EP (1u << MOE_RUN_EP)
#define M_HC (1u << MOE_RUN_HC)
#define M_BLOCK (M_CPU | M_CUDA | M_EP)

typedef moe_cli_run_args A;

static const moe_cli_choice block_choices[] = {{"moe", MOE_BLOCK_MOE}, {"hc_ffn", MOE_BLOCK_HC_FFN},
                                               {"hc_attn", MOE_BLOCK_HC_ATTN}, {NULL, 0}};
static const moe_cli_choice device_choices[] = {{"cpu", MOE_DEV_CPU}, {"cuda", MOE_DEV_CUDA}, {NULL, 0}};
static const moe_cli_choice owner_choices[] = {{"router", MOE_SCALE_ROUTER}, {"runner", MOE_SCALE_RUNNER},
                                               {"output", MOE_SCALE_OUTPUT}, {NULL, 0}};
static const moe_cli_choice gpath_choices[] = {{"auto", MOE_GPATH_AUTO}, {"gemv", MOE_GPATH_GEMV},
                                               {"gemv-f32", MOE_GPATH_GEMV_F32}, {"grouped", MOE_GPATH_GROUPED},
                                               {"mma", MOE_GPATH_MMA}, {"wgmma", MOE_GPATH_WGMMA},
                                               {"wgmma-cp", MOE_GPATH_WGMMA_CP}, {"wgmma-pd", MOE_GPATH_WGMMA_PD},
                                               {"wgmma-bf16", MOE_GPATH_WGMMA_BF16},
                                               {NULL, 0}};

static const moe_opt run_opts[] = {
    {"block", "B", MOE_OPT_CHOICE, offsetof(A, block), 0, 0, block_choices, 0,
     "moe (default): the MoE block; hc_ffn, hc_attn: layer N's mHC hyper-connection\n"
     "before the MoE block or before attention (V4)", NULL},
    MOE_OPT_MODEL(A, "checkpoint directory (config.json + safetensors), or a bundled checkpoint:\n"
                     "dsv4-tiny (default), dsv3-tiny, dsv3-tiny-fp8"),
    MOE_OPT_LAYER(A, "layer index; default: every MoE layer (--block hc_*: layer 0)"),
    MOE_OPT_INPUT(A, "safetensors with hidden [T, H] (F32, F64, BF16 or F16) and, on hash layers,\n"
                     "input_ids [T] (I32 or I64); --block hc_*: streams [T, hc_mult, H].\n"
                     "Default: a built-in input of --tokens tokens drawn from a fixed seed"),
    MOE_OPT_OUTPUT(A, "write router_logits [T, E], topk_ids [T, K] (I32), topk_weights [T, K],\n"
                      "eff_weights, routed_out, shared_out, moe_out [T, H]; F64 with --precision ref,\n"
                      "F32 with f32 and on the GPU. Without --layer, names get a \"layerN.\" prefix.\n"
                      "--block hc_*: pre, post, comb, collapsed (F64). '-': the bytes to stdout"),
    {"tokens", "T", MOE_OPT_INT, offsetof(A, tokens), 1, 1 << 24, NULL, 0,
     "tokens of the built-in input (default 8)", NULL},
    MOE_OPT_PRECISION(A, "ref: float64 reference (default); f32: float32 path. --device cuda: f32 only\n"
                         "(bf16 tensor-core operands, fp32 accumulation); ref is refused there.\n"
                         "--block hc_*: the MHC linear in ref, f32, tf32, bf16 or bf16-split"),
    {"act", "A", MOE_OPT_STR, offsetof(A, c.act), 0, 0, NULL, M_BLOCK,
     "round the expert GEMMs' input activations: exact (default on the CPU), bf16\n"
     "(default on the GPU), fp8 (E4M3 per 128, power-of-two scale: V3.1+/V4),\n"
     "fp8-f32scale (E4M3 per 128, fp32 scale: V3), nvfp4 (W4A4: E2M1 + UE4M3 per 16\n"
     "with the checkpoint's static input_scale, one per expert GEMM for the layer, as\n"
     "TensorRT-LLM / FlashInfer), nvfp4-expert (each expert's own input_scale, as vLLM's\n"
     "CUTLASS MoE); the nvfp4 modes need NVFP4 experts with input_scale, on the CPU", NULL},
    {"scale-owner", "O", MOE_OPT_CHOICE, offsetof(A, owner), 0, 0, owner_choices, M_BLOCK,
     "who applies routed_scaling_factor: router (default), runner, output", NULL},
    {"fuse-shared", NULL, MOE_OPT_FLAG, offsetof(A, fuse_shared), 0, 0, NULL, M_BLOCK,
     "run the shared expert as routed column E with the weight its owner needs", NULL},
    {"check", NULL, MOE_OPT_FLAG, offsetof(A, check), 0, 0, NULL, M_BLOCK,
     "verify the scaling contract on every token (exit 1 if violated)", NULL},
    {"device", "D", MOE_OPT_CHOICE, offsetof(A, device), 0, 0, device_choices, 0,
     "cpu (default) or cuda (built with CUDA, on a GPU)", NULL},
    {"ep", "N", MOE_OPT_INT, offsetof(A, ep), 1, 1 << 20, NULL, M_EP,
     "expert parallelism over N MPI ranks: mpirun -np N moeaudit run --ep N ...;\n"
     "outputs bit-identical to the single-process run", NULL},
    {"placement", "FILE", MOE_OPT_STR, offsetof(A, placement), 0, 0, NULL, M_EP,
     "experts per rank: \"EXPERT RANK\" lines or a JSON array of ranks (default:\n"
     "contiguous ranges)", NULL},
    {"compare", NULL, MOE_OPT_FLAG, offsetof(A, compare), 0, 0, NULL, M_CUDA,
     "also run the CPU float64 reference with the same activation rounding and print\n"
     "||gpu - ref|| / ||ref|| and the tokens routed differently", NULL},
    {"path", "P", MOE_OPT_CHOICE, offsetof(A, gpath), 0, 0, gpath_choices, M_CUDA,
     "GPU expert kernels: auto (default), gemv (small T), gemv-f32, grouped (FP4, moderate T),\n"
     "wgmma (grouped GEMMs on Hopper's wgmma, TMA loads, FP8/FP4 weights decoded beside\n"
     "the MMAs; FP8 weights with --act fp8 or fp8-f32scale on the FP8 tensor cores),\n"
     "wgmma-bf16 (wgmma with bf16 operands: FP8 activations rounded, then multiplied as\n"
     "bf16), wgmma-pd (the same with the decode in the producer warpgroup), wgmma-cp\n"
     "(wgmma-pd with cp.async loads), mma (the older mma.sync GEMMs)", NULL},
    {"audit", NULL, MOE_OPT_FLAG, offsetof(A, audit), 0, 0, NULL, M_HC,
     "compare every MHC precision against ref: collapsed and post max relative error,\n"
     "comb max abs error, distance of comb from doubly stochastic", NULL},
    {"json", "FILE", MOE_OPT_OUT, offsetof(A, c.json), 0, 0, NULL, M_HC,
     "the run summary or the --audit rows as one JSON document ('-': stdout)", NULL},
    {"threads", "N", MOE_OPT_INT, offsetof(A, c.threads), 1, 4096, NULL, M_CPU | M_EP | M_HC,
     "OpenMP threads (default: OMP_NUM_THREADS, else all cores)", NULL},
    {"isa", "I", MOE_OPT_STR, offsetof(A, c.isa), 0, 0, NULL, M_CPU | M_EP,
     "CPU kernel table of the f32 path: ref, avx2 or avx512 (default: the best this\n"
     "CPU has, or MOE_ISA)", NULL},
    MOE_OPT_QUIET(A, "no summary on stdout (errors still go to stderr)"),
};

static const char *const run_modes[] = {"the CPU MoE block", "--device cuda", "--ep N", "--block hc_ffn|hc_attn", NULL};

static int run_main(int argc, char **argv);

const moe_cli_cmd moe_cli_run = {
    "run",
    "run one MoE block (or every MoE layer) of a checkpoint on a batch of tokens",
    "moeaudit run [--model DIR] [--layer N] [--input IN] [--output OUT] [--precision ref|f32]\n"
    "             [--act exact|bf16|fp8|fp8-f32scale|nvfp4|nvfp4-expert]\n"
    "             [--scale-owner router|runner|output]\n"
    "             [--fuse-shared] [--check] [--tokens T] [--threads N] [--isa I] [--quiet]\n"
    "moeaudit run --device cuda [--compare] [--path P] [block options]\n"
    "mpirun -np N moeaudit run --ep N [--placement FILE] [block options]\n"
    "moeaudit run --block hc_ffn|hc_attn [--model DIR] [--layer N] [--input IN] [--output OUT]\n"
    "             [--precision P] [--audit] [--json FILE]",
    "Run the MoE block of layer N of a DeepSeek V3/V4 checkpoint on the tokens of IN: router,\n"
    "routed experts, shared expert and the combine, in float64 (the reference) or float32.\n"
    "Every --scale-owner and --fuse-shared combination gives the same moe_out; --check proves it\n"
    "per token. Without --model, --input and --layer, run uses the bundled dsv4-tiny checkpoint\n"
    "and 8 tokens drawn from a fixed seed, and prints a summary per MoE layer.",
    run_opts,
    (int)(sizeof run_opts / sizeof run_opts[0]),
    run_modes,
    "Exit status: 0 success, 1 failure (including a contract violation), 2 usage or input error.",
    run_main,
};

/* ------------------------------------------------------------- CPU block */

static void summarize(FILE *f, const moe_layer *L, const moe_block_out *o, const moe_run_opts *opts) {
    const moe_block_config *c = &L->cfg;
    static const char *const kinds[] = {"dense", "top-k", "hash"};
    static const char *const scores[] = {"softmax", "sigmoid", "sqrtsoftplus"};
    fprintf(f, "layer %d: %s routing, %s scores, E=%d K=%d, s=%g, swiglu_limit=%g, shared=%s%s\n", L->index,
            kinds[c->kind], scores[c->score], c->n_experts, c->top_k, c->scaling, c->swiglu_limit,
            c->shared_inter ? "yes" : "no", opts->fuse_shared ? " (fused column)" : "");
    /* expert load and weight sums */
    int *load = calloc((size_t)c->n_experts + 1, sizeof(int));
    double wmin = INFINITY, wmax = -INFINITY, emin = INFINITY, emax = -INFINITY;
    for (int64_t t = 0; t < o->T; t++) {
        double ws = 0, es = 0;
        for (int j = 0; j < c->top_k; j++) {
            if (load) load[o->topk_ids[t * o->n_cols + j]]++;
            ws += o->topk_weights[t * o->n_cols + j];
            es += o->eff_weights[t * o->n_cols + j];
        }
        wmin = fmin(wmin, ws); wmax = fmax(wmax, ws);
        emin = fmin(emin, es); emax = fmax(emax, es);
    }
    fprintf(f, "  tokens %lld; first token's experts:", (long long)o->T);
    for (int j = 0; j < o->n_cols; j++) fprintf(f, " %d (w %.4f)", o->topk_ids[j], o->topk_weights[j]);
    fprintf(f, "\n  expert load:");
    for (int e = 0; load && e < c->n_experts; e++) fprintf(f, " %d", load[e]);
    free(load);
    fprintf(f, "\n  emitted routed weight sum per token: [%.6f, %.6f] (owner %s); effective: [%.6f, %.6f] (s = %g)\n",
            wmin, wmax, moe_scale_owner_name(opts->owner), emin, emax, c->scaling);
    if (L->nvfp4_scale2_mismatch)
        fprintf(f, "  NVFP4: %d experts have gate and up weight_scale_2 that differ; computed exactly here, but a fused\n"
                   "  gate/up GEMM must rescale block scales to the larger one: up to %.2g relative change of a block scale\n",
                L->nvfp4_scale2_mismatch, L->nvfp4_reconcile_loss);
    double nr = 0, ns = 0, no = 0;
    for (int64_t i = 0; i < o->T * o->H; i++) {
        nr += o->routed_out[i] * o->routed_out[i];
        ns += o->shared_out[i] * o->shared_out[i];
        no += o->moe_out[i] * o->moe_out[i];
    }
    fprintf(f, "  RMS: routed %.6g, shared %.6g, moe_out %.6g\n", sqrt(nr / (double)(o->T * o->H)),
            sqrt(ns / (double)(o->T * o->H)), sqrt(no / (double)(o->T * o->H)));
}

/* The output of `run` over every MoE layer, streamed (#12 item 6: the
 * outputs of all layers were held in memory, about 41 GB for V3 at 4,096
 * tokens; 10 or more layers overflowed the writer's 64 tensors and ended in
 * "out of memory", and past 64 layers the run stopped silently). The header
 * is written first from the shapes every layer will have (known before any
 * layer runs), then each layer's seven tensors as it finishes, then the file
 * is committed atomically: memory holds one layer's outputs, and a failure
 * at any layer leaves no file (the old one, if any, intact). */
#define RUN_TENSORS 7
static const char *const run_tensor_names[RUN_TENSORS] = {"router_logits", "topk_ids", "topk_weights", "eff_weights",
                                                          "routed_out", "shared_out", "moe_out"};

typedef struct run_stream {
    moe_st_stream *st;
    moe_st_entry *e;      /* [n_layers * RUN_TENSORS] */
    char (*names)[48];    /* [n_layers * RUN_TENSORS] */
    int n;                /* entries */
    float *buf;           /* f32 staging, [max tensor elements] */
    size_t buf_n;
} run_stream;

static void run_stream_free(run_stream *w) {
    moe_st_stream_abort(w->st);
    free(w->e);
    free(w->names);
    free(w->buf);
    memset(w, 0, sizeof *w);
}

/* Entries for layers [n] (E [n], n_cols [n]) of T tokens, H wide; names
 * "layer<N>.<tensor>" when prefixed (every layer), else "<tensor>". */
static int run_stream_open(run_stream *w, const char *path, const int *layers, const int *E, const int *cols, int n,
                           int64_t T, int H, bool f32, bool prefixed) {
    static const char *const meta[] = {"producer", MOE_CLI_TOOL, NULL};
    memset(w, 0, sizeof *w);
    w->e = calloc((size_t)n * RUN_TENSORS + 1, sizeof *w->e);
    w->names = calloc((size_t)n * RUN_TENSORS + 1, sizeof *w->names);
    if (!w->e || !w->names) { fprintf(stderr, "moeaudit: out of memory\n"); run_stream_free(w); return EXIT_FAIL; }
    size_t most = 0;
    for (int l = 0; l < n; l++)
        for (int k = 0; k < RUN_TENSORS; k++) {
            moe_st_entry *e = &w->e[w->n];
            if (prefixed) snprintf(w->names[w->n], sizeof w->names[0], "layer%d.%s", layers[l], run_tensor_names[k]);
            else snprintf(w->names[w->n], sizeof w->names[0], "%s", run_tensor_names[k]);
            e->name = w->names[w->n];
            e->ndim = 2;
            e->shape[0] = T;
            e->shape[1] = k == 0 ? E[l] : k <= 3 ? cols[l] : H;
            e->dtype = k == 1 ? MOE_DTYPE_I32 : f32 ? MOE_DTYPE_F32 : MOE_DTYPE_F64;
            e->data = NULL;
            size_t elems = (size_t)T * (size_t)e->shape[1];
            if (elems > most) most = elems;
            w->n++;
        }
    if (f32) {
        w->buf = malloc(most * sizeof(float) + 1);
        w->buf_n = most;
        if (!w->buf) { fprintf(stderr, "moeaudit: out of memory\n"); run_stream_free(w); return EXIT_FAIL; }
    }
    moe_error err;
    moe_status st = moe_st_stream_open(path, w->e, (size_t)w->n, meta, &w->st, &err);
    if (st != MOE_OK) { run_stream_free(w); return moe_cli_fail(st, &err); }
    return EXIT_OKAY;
}

/* Layer l's (the l-th streamed) seven tensors from o. */
static int run_stream_put(run_stream *w, int l, const moe_block_out *o, bool f32) {
    const double *src[RUN_TENSORS] = {o->router_logits, NULL, o->topk_weights, o->eff_weights,
                                      o->routed_out, o->shared_out, o->moe_out};
    for (int k = 0; k < RUN_TENSORS; k++) {
        const moe_st_entry *e = &w->e[l * RUN_TENSORS + k];
        size_t elems = (size_t)e->shape[0] * (size_t)e->shape[1];
        const void *data = k == 1 ? (const void *)o->topk_ids : (const void *)src[k];
        size_t nb = elems * (k == 1 ? sizeof(int32_t) : f32 ? sizeof(float) : sizeof(double));
        if (k != 1 && f32) {
            for (size_t i = 0; i < elems; i++) w->buf[i] = (float)src[k][i];
            data = w->buf;
        }
        moe_error err;
        moe_status st = moe_st_stream_put(w->st, (size_t)(l * RUN_TENSORS + k), 0, data, nb, &err);
        if (st != MOE_OK) return moe_cli_fail_out(st, &err);
    }
    return EXIT_OKAY;
}

int moe_run_cpu(const moe_cli_run_args *a) {
    const moe_run_opts *opts = &a->o;
    long layer = a->c.layer;
    bool f32 = opts->precision == MOE_PREC_F32;
    FILE *out = moe_cli_text(a->c.quiet, a->c.output && !strcmp(a->c.output, "-"));
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(a->model, &m, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    const moe_model_info *info = moe_model_get_info(m);
    moe_cli_input in = {0};
    int rc = a->c.input ? moe_cli_read_input(a->c.input, info->hidden, &in)
                        : moe_cli_builtin_input(&in, a->tokens, info->hidden, info->vocab);
    if (rc != EXIT_OKAY) { moe_model_free(m); return rc; }
    if (out)
        fprintf(out, "model %s (%s, %d layers), %lld tokens, precision %s, activations %s\n", a->model,
                info->model_type, info->n_layers, (long long)in.T,
                opts->precision == MOE_PREC_REF ? "ref (float64)" : "f32", moe_act_prec_name(opts->act));

    /* The MoE layers to run, each checked (loaded, ids present for a hash
     * layer, its output shape) before anything runs or is written. */
    int first = layer >= 0 ? (int)layer : 0, last = layer >= 0 ? (int)layer : info->n_layers - 1;
    int n_max = last - first + 1, n = 0;
    int *ids = calloc((size_t)n_max + 1, sizeof(int)), *E = calloc((size_t)n_max + 1, sizeof(int)),
        *cols = calloc((size_t)n_max + 1, sizeof(int));
    const moe_layer **Ls = calloc((size_t)n_max + 1, sizeof *Ls);
    if (!ids || !E || !cols || !Ls) { fprintf(stderr, "moeaudit: out of memory\n"); rc = EXIT_FAIL; }
    for (int li = first; li <= last && rc == EXIT_OKAY; li++) {
        moe_layer_kind kind = MOE_LAYER_DENSE;
        st = moe_model_layer_kind(m, li, &kind, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        if (kind == MOE_LAYER_DENSE) {
            if (layer >= 0) { rc = moe_cli_fail(MOE_ERR_ARG, &(moe_error){"layer is dense: it has no MoE block"}); break; }
            continue;
        }
        const moe_layer *L;
        st = moe_model_layer(m, li, &L, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        if (L->cfg.kind == MOE_LAYER_HASH && !in.ids) {
            fprintf(stderr, "moeaudit: %s: layer %d is hash-routed and needs tensor input_ids [T]\n",
                    a->c.input ? a->c.input : "(built-in input)", li);
            rc = EXIT_USAGE;
            break;
        }
        moe_block_out probe; /* the output's widths, from a one-token block */
        st = moe_block_out_init(&probe, L, 1, opts, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        ids[n] = li;
        E[n] = probe.E;
        cols[n] = probe.n_cols;
        Ls[n++] = L;
        moe_block_out_free(&probe);
    }
    char tmp[4096] = "";
    const char *opath = a->c.output;
    if (rc == EXIT_OKAY && opath && !strcmp(opath, "-")) { /* the whole file first, then its bytes to stdout */
        if (moe_cli_private_tmp(tmp, sizeof tmp, "run.safetensors")) opath = tmp;
        else rc = EXIT_FAIL;
    }
    run_stream w = {0};
    if (rc == EXIT_OKAY && opath) rc = run_stream_open(&w, opath, ids, E, cols, n, in.T, info->hidden, f32, layer < 0);
    for (int l = 0; l < n && rc == EXIT_OKAY; l++) {
        const moe_layer *L = Ls[l];
        moe_block_out o;
        st = moe_block_out_init(&o, L, in.T, opts, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        st = moe_block_run(L, in.hidden, in.ids, in.T, opts, &o, &err);
        if (st != MOE_OK) rc = moe_cli_fail(st, &err);
        if (rc == EXIT_OKAY && out) summarize(out, L, &o, opts);
        if (rc == EXIT_OKAY && out && opts->check_invariants)
            fprintf(out, "  contract check: ok (effective routed weights = s * w, shared weight 1)\n");
        if (rc == EXIT_OKAY && w.st) rc = run_stream_put(&w, l, &o, f32);
        moe_block_out_free(&o);
    }
    if (rc == EXIT_OKAY && w.st) {
        moe_st_stream *s = w.st;
        w.st = NULL;
        st = moe_st_stream_finish(s, &err);
        if (st != MOE_OK) rc = moe_cli_fail_out(st, &err);
        else if (tmp[0]) {
            FILE *f = fopen(tmp, "rb");
            char buf[1 << 16];
            size_t got;
            bool ok = f != NULL;
            while (ok && (got = fread(buf, 1, sizeof buf, f)) > 0) ok = fwrite(buf, 1, got, stdout) == got;
            if (f) fclose(f);
            if (!ok || fflush(stdout) != 0) {
                fprintf(stderr, "moeaudit: stdout: writing the safetensors bytes failed\n");
                rc = EXIT_FAIL;
            }
        } else if (!a->c.quiet)
            printf("wrote %d tensors to %s\n", w.n, a->c.output);
    }
    run_stream_free(&w);
    moe_cli_private_tmp_done(tmp);
    free(ids);
    free(E);
    free(cols);
    free(Ls);
    moe_cli_input_free(&in);
    moe_model_free(m);
    return rc;
}

/* ---------------------------------------------------------------- parse */

/* The precisions and the block options of the mode, into a->o. */
static int resolve(moe_cli_run_args *a, int mode) {
    const char *cmd = "run";
    a->o = moe_run_opts_default();
    const char *p = a->c.precision, *act = a->c.act;
    const moe_cli_prec *e;
    if (mode == MOE_RUN_HC) {
        if (p && !(e = moe_cli_prec_find(p, MOE_PU_HC))) return moe_cli_prec_bad(cmd, "precision", p, MOE_PU_HC);
        moe_hc_prec hp = MOE_HC_REF;
        if (p && !moe_hc_prec_parse(e->name, &hp)) return moe_cli_prec_bad(cmd, "precision", p, MOE_PU_HC);
        a->hc_prec = (int)hp;
        return -1;
    }
    if (mode == MOE_RUN_CUDA) {
        a->o.act = MOE_ACT_BF16;
        a->o.precision = MOE_PREC_F32;
        if (p && !strcmp(p, "ref"))
            return moe_cli_usage(cmd, "%s", "--precision ref with --device cuda: the GPU does not compute in float64 "
                                            "(it runs bf16 tensor-core operands with fp32 accumulation, --precision "
                                            "f32); run without --device cuda for the float64 reference, or add "
                                            "--compare to measure the GPU against it");
        if (p && (e = moe_cli_prec_find(p, MOE_PU_BLOCK)) && !strcmp(e->name, "f32")) p = NULL;
        if (p) {
            /* the old spelling: --precision bf16|fp8|fp8-f32scale meant --act on the GPU */
            if (!moe_cli_prec_find(p, MOE_PU_GPU_ACT)) return moe_cli_prec_bad(cmd, "precision", p, MOE_PU_BLOCK);
            if (act) return moe_cli_usage(cmd, "--precision %s and --act both given: the activation rounding is --act", p);
            fprintf(stderr, "moeaudit run: note: --precision %s with --device cuda is read as --act %s (its old "
                            "spelling)\n", p, p);
            act = p;
        }
        if (act) {
            if (moe_cli_prec_find(act, MOE_PU_ACT) && !strcmp(moe_cli_prec_find(act, MOE_PU_ACT)->name, "exact"))
                return moe_cli_usage(cmd, "--act %s with --device cuda: the GPU's tensor cores take bf16 or fp8 "
                                          "activations, never unrounded ones; use --act bf16 (its default), fp8 or "
                                          "fp8-f32scale", act);
            if (!(e = moe_cli_prec_find(act, MOE_PU_GPU_ACT))) return moe_cli_prec_bad(cmd, "act", act, MOE_PU_GPU_ACT);
            moe_act_prec_parse(e->name, &a->o.act);
        }
    } else {
        if (p) {
            if (!(e = moe_cli_prec_find(p, MOE_PU_BLOCK))) return moe_cli_prec_bad(cmd, "precision", p, MOE_PU_BLOCK);
            a->o.precision = !strcmp(e->name, "ref") ? MOE_PREC_REF : MOE_PREC_F32;
        }
        if (act) {
            if (!(e = moe_cli_prec_find(act, MOE_PU_ACT))) return moe_cli_prec_bad(cmd, "act", act, MOE_PU_ACT);
            moe_act_prec_parse(e->name, &a->o.act);
        }
    }
    a->o.owner = (moe_scale_owner)a->owner;
    a->o.fuse_shared = a->fuse_shared;
    a->o.check_invariants = a->check;
    if (a->o.fuse_shared && a->o.owner == MOE_SCALE_OUTPUT)
        return moe_cli_usage(cmd, "%s", "--fuse-shared cannot be used with --scale-owner output: the output "
                                        "stage would scale the shared column too");
    return -1;
}

static int run_main(int argc, char **argv) {
    moe_cli_run_args a;
    memset(&a, 0, sizeof a);
    a.c = moe_cli_common_default();
    a.tokens = 8;
    a.owner = MOE_SCALE_ROUTER;
    bool seen[MOE_CLI_MAX_OPTS];
    int rc = moe_cli_parse(&moe_cli_run, argc, argv, &a, seen);
    if (rc >= 0) return rc;
    int mode;
    if (a.block != MOE_BLOCK_MOE) {
        if (a.device == MOE_DEV_CUDA) return moe_cli_usage("run", "%s", "--device cuda runs the moe block only, not --block hc_*");
        mode = MOE_RUN_HC;
    } else if (a.device == MOE_DEV_CUDA) {
        if (a.ep > 0) return moe_cli_usage("run", "%s", "--ep and --device cuda cannot be combined");
        mode = MOE_RUN_CUDA;
    } else {
        mode = a.ep > 0 ? MOE_RUN_EP : MOE_RUN_CPU;
    }
    if ((rc = moe_cli_check_modes(&moe_cli_run, seen, mode)) >= 0) return rc;
    if ((rc = resolve(&a, mode)) >= 0) return rc;
    if (mode == MOE_RUN_HC && a.c.layer < 0) a.c.layer = 0;
    char model[PATH_MAX];
    if (!(a.model = moe_cli_model_path(a.c.model, model, sizeof model))) return EXIT_USAGE;
    {
        const char *outs[2] = {a.c.output, a.c.json}, *ins[1] = {a.c.input};
        if ((rc = moe_cli_check_outputs("run", outs, 2, ins, 1, a.model)) >= 0) return rc;
    }
    moe_isa isa = MOE_ISA_AUTO;
    if ((rc = moe_cli_apply_common("run", &a.c, &isa)) >= 0) return rc;
    a.o.isa = isa;
    switch (mode) {
    case MOE_RUN_HC: return moe_run_hc(&a);
    case MOE_RUN_CUDA: return moe_run_cuda(&a);
    case MOE_RUN_EP: return moe_run_ep(&a);
    default: return moe_run_cpu(&a);
    }
}
