/*
 * moeaudit: the command-line tool. Parses arguments, calls the library,
 * prints. The only place in the project where exit() and printing live.
 *
 * Exit codes: 0 success, 1 failure, 2 usage or input error.
 */
#include "moeaudit.h"
#include "cli.h"
#include "cmd_extra.h"
#include "cmd_forward.h"
#include "cmd_cuda.h"
#include "cmd_mpi.h"
#include "bench/bench.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MOE_DEFAULT_MODEL
#define MOE_DEFAULT_MODEL "tests/data/dsv4-tiny"
#endif

/* ------------------------------------------------------------------ run */

static const char run_help[] =
    "usage: moeaudit run [--block moe|hc_ffn|hc_attn] [--model DIR] [--layer N] [--input IN.safetensors] [--output OUT.safetensors]\n"
    "                    [--precision ref|f32] [--scale-owner router|runner|output] [--fuse-shared]\n"
    "                    [--act exact|bf16|fp8|fp8-f32scale] [--check] [--tokens T]\n"
    "                    [--device cpu|cuda] [--ep N (under mpirun)]\n"
    "\n"
    "Run the MoE block of layer N of a DeepSeek V3/V4 checkpoint on the tokens of IN.\n"
    "(--block hc_ffn|hc_attn runs a V4 hyper-connection instead: 'moeaudit run --block hc_ffn --help'.)\n"
    "\n"
    "  --model DIR        checkpoint directory (config.json + safetensors); default: the bundled\n"
    "                     tiny DeepSeek V4 checkpoint\n"
    "  --layer N          layer index; default: every MoE layer of the model\n"
    "  --input FILE       safetensors with hidden [T, H] (F32, F64, BF16 or F16) and, on hash\n"
    "                     layers, input_ids [T] (I32 or I64); default: a built-in input of\n"
    "                     --tokens tokens (8) drawn from a fixed seed\n"
    "  --output FILE      write router_logits [T, E], topk_ids [T, K] (I32), topk_weights [T, K],\n"
    "                     eff_weights, routed_out, shared_out, moe_out [T, H]; F64 with\n"
    "                     --precision ref, F32 with f32. Without --layer, names get a \"layerN.\" prefix\n"
    "  --precision P      ref: float64 reference (default); f32: float32 path\n"
    "  --act A            round the expert GEMMs' input activations: exact (default), bf16,\n"
    "                     fp8 (E4M3 per 128, power-of-two scale: V4), fp8-f32scale (V3)\n"
    "  --scale-owner O    who applies routed_scaling_factor: router (default), runner, output\n"
    "  --fuse-shared      run the shared expert as routed column E with the weight its owner needs\n"
    "  --check            verify the scaling contract on every token (exit 1 if violated)\n"
    "  --device cuda      run on the GPU ('moeaudit run --device cuda --help' when built with CUDA)\n"
    "  --ep N             expert parallelism over N MPI ranks: mpirun -np N moeaudit run --ep N ...\n"
    "\n"
    "Exit status: 0 success, 1 failure (including a contract violation), 2 usage or input error.\n";

static void summarize(const moe_layer *L, const moe_block_out *o, const moe_run_opts *opts) {
    const moe_block_config *c = &L->cfg;
    static const char *const kinds[] = {"dense", "top-k", "hash"};
    static const char *const scores[] = {"softmax", "sigmoid", "sqrtsoftplus"};
    printf("layer %d: %s routing, %s scores, E=%d K=%d, s=%g, swiglu_limit=%g, shared=%s%s\n", L->index,
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
    printf("  tokens %lld; first token's experts:", (long long)o->T);
    for (int j = 0; j < o->n_cols; j++)
        printf(" %d (w %.4f)", o->topk_ids[j], o->topk_weights[j]);
    printf("\n  expert load:");
    for (int e = 0; load && e < c->n_experts; e++) printf(" %d", load[e]);
    free(load);
    printf("\n  emitted routed weight sum per token: [%.6f, %.6f] (owner %s); effective: [%.6f, %.6f] (s = %g)\n",
           wmin, wmax, moe_scale_owner_name(opts->owner), emin, emax, c->scaling);
    if (L->nvfp4_scale2_mismatch)
        printf("  NVFP4: %d experts have gate and up weight_scale_2 that differ; computed exactly here, but a fused\n"
               "  gate/up GEMM must rescale block scales to the larger one: up to %.2g relative change of a block scale\n",
               L->nvfp4_scale2_mismatch, L->nvfp4_reconcile_loss);
    double nr = 0, ns = 0, no = 0;
    for (int64_t i = 0; i < o->T * o->H; i++) {
        nr += o->routed_out[i] * o->routed_out[i];
        ns += o->shared_out[i] * o->shared_out[i];
        no += o->moe_out[i] * o->moe_out[i];
    }
    printf("  RMS: routed %.6g, shared %.6g, moe_out %.6g\n", sqrt(nr / (double)(o->T * o->H)),
           sqrt(ns / (double)(o->T * o->H)), sqrt(no / (double)(o->T * o->H)));
}

/* `run --device cuda` and `run --ep N` go to their own commands (which parse
 * the same options); so do `bench --device cuda` and `bench --ep N`. */
static int route(int argc, char **argv, int (*cuda)(int, char **), int (*ep)(int, char **)) {
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--device")) {
            if (!strcmp(argv[i + 1], "cuda")) return cuda(argc, argv);
            if (strcmp(argv[i + 1], "cpu")) return moe_cli_usage(argv[0], "--device %s: expected cpu or cuda", argv[i + 1]);
        }
        if (!strcmp(argv[i], "--ep")) return ep(argc, argv);
    }
    return -1;
}

static int cmd_run(int argc, char **argv) {
    int routed = route(argc, argv, moe_cmd_run_cuda, moe_cmd_run_ep);
    if (routed >= 0) return routed;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--block")) {
            if (!strncmp(argv[i + 1], "hc_", 3)) return moe_cmd_run_hc(argc, argv);
            if (strcmp(argv[i + 1], "moe")) return moe_cli_usage("run", "--block %s: expected moe, hc_ffn or hc_attn", argv[i + 1]);
        }
    const char *model_dir = MOE_DEFAULT_MODEL, *in_path = NULL, *out_path = NULL;
    long layer = -1, tokens = 8;
    moe_run_opts opts = moe_run_opts_default();
    int isa_rc = moe_cli_isa_default(&opts.isa);
    if (isa_rc != EXIT_OKAY) return isa_rc;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(run_help, stdout); return EXIT_OKAY; }
        else if (!strcmp(a, "--fuse-shared")) opts.fuse_shared = true;
        else if (!strcmp(a, "--check")) opts.check_invariants = true;
        else if (!has_val && !strncmp(a, "--", 2)) return moe_cli_usage("run", "option %s needs a value", a);
        else if (!strcmp(a, "--model")) model_dir = argv[++i];
        else if (!strcmp(a, "--block")) ++i; /* "moe": the default */
        else if (!strcmp(a, "--device")) ++i; /* "cpu": the default */
        else if (!strcmp(a, "--input")) in_path = argv[++i];
        else if (!strcmp(a, "--output")) out_path = argv[++i];
        else if (!strcmp(a, "--layer")) {
            if (!moe_cli_parse_int(argv[++i], 0, 1000000, &layer)) return moe_cli_usage("run", "--layer %s: not a layer index", argv[i]);
        } else if (!strcmp(a, "--tokens")) {
            if (!moe_cli_parse_int(argv[++i], 1, 1 << 24, &tokens)) return moe_cli_usage("run", "--tokens %s: not a positive count", argv[i]);
        } else if (!strcmp(a, "--precision")) {
            const char *p = argv[++i];
            if (!strcmp(p, "ref")) opts.precision = MOE_PREC_REF;
            else if (!strcmp(p, "f32")) opts.precision = MOE_PREC_F32;
            else return moe_cli_usage("run", "--precision %s: expected ref or f32", p);
        } else if (!strcmp(a, "--act")) {
            if (!moe_act_prec_parse(argv[++i], &opts.act))
                return moe_cli_usage("run", "--act %s: expected exact, bf16, fp8 or fp8-f32scale", argv[i]);
        } else if (!strcmp(a, "--scale-owner")) {
            if (!moe_scale_owner_parse(argv[++i], &opts.owner))
                return moe_cli_usage("run", "--scale-owner %s: expected router, runner or output", argv[i]);
        } else return moe_cli_usage("run", "unknown argument %s", a);
    }
    if (opts.fuse_shared && opts.owner == MOE_SCALE_OUTPUT)
        return moe_cli_usage("run", "%s", "--fuse-shared cannot be used with --scale-owner output: the output "
                                        "stage would scale the shared column too");

    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(model_dir, &m, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    const moe_model_info *info = moe_model_get_info(m);
    moe_cli_input in = {0};
    int rc = in_path ? moe_cli_read_input(in_path, info->hidden, &in) : moe_cli_builtin_input(&in, tokens, info->hidden, info->vocab);
    if (rc != EXIT_OKAY) { moe_model_free(m); return rc; }
    printf("model %s (%s, %d layers), %lld tokens, precision %s, activations %s\n", model_dir, info->model_type,
           info->n_layers, (long long)in.T, opts.precision == MOE_PREC_REF ? "ref (float64)" : "f32",
           moe_act_prec_name(opts.act));

    int first = layer >= 0 ? (int)layer : 0, last = layer >= 0 ? (int)layer : info->n_layers - 1;
    moe_cli_writer w = {.n = 0};
    moe_block_out outs[64];
    int n_out = 0;
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
                    in_path ? in_path : "(built-in input)", li);
            rc = EXIT_USAGE;
            break;
        }
        if (n_out == 64) break;
        moe_block_out *o = &outs[n_out];
        st = moe_block_out_init(o, L, in.T, &opts, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        n_out++;
        st = moe_block_run(L, in.hidden, in.ids, in.T, &opts, o, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        summarize(L, o, &opts);
        if (opts.check_invariants) printf("  contract check: ok (effective routed weights = s * w, shared weight 1)\n");
        if (out_path) {
            char prefix[32] = "";
            if (layer < 0) snprintf(prefix, sizeof prefix, "layer%d.", li);
            int e = moe_cli_writer_add_block(&w, prefix, o, opts.precision == MOE_PREC_F32);
            if (e) { fprintf(stderr, "moeaudit: out of memory\n"); rc = EXIT_FAIL; }
        }
    }
    rc = moe_cli_writer_finish(&w, out_path, rc);
    for (int i = 0; i < n_out; i++) moe_block_out_free(&outs[i]);
    moe_cli_input_free(&in);
    moe_model_free(m);
    return rc;
}

/* ----------------------------------------------------------------- main */

static const char main_help[] =
    "usage: moeaudit <command> [options]\n"
    "\n"
    "Run and audit DeepSeek V3/V4 Mixture-of-Experts blocks.\n"
    "\n"
    "commands:\n"
    "  run        run one MoE block (or every MoE layer) of a checkpoint on a batch of tokens\n"
    "  forward    the whole DeepSeek-V4 model on a token sequence: every layer's streams, blocks,\n"
    "             index sets and the logits, exactly (float64) or in f32; chunked prefill + decode;\n"
    "             --ep N under mpirun splits every layer's routed experts over N processes\n"
    "  audit      grade every precision path against float64 (synthetic V4-Flash model by default)\n"
    "  bench      time the routed experts against the memory and compute floors (--device cuda, --ep N)\n"
    "  diagnose   name the broken contract in another engine's dump of one layer\n"
    "  needle     would the lightning indexer keep a fact planted N tokens back? recall per precision\n"
    "  quantize   write an FP8 / MXFP4 / NVFP4 copy of a BF16 checkpoint in release layouts\n"
    "\n"
    "'moeaudit <command> --help' describes a command. Exit status: 0 success, 1 failure,\n"
    "2 usage or input error.\n";

int main(int argc, char **argv) {
    if (argc < 2) { fputs(main_help, stderr); return EXIT_USAGE; }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) { fputs(main_help, stdout); return 0; }
    if (!strcmp(cmd, "--version")) { printf("moeaudit %s\n", MOEAUDIT_VERSION); return 0; }
    if (!strcmp(cmd, "run")) return cmd_run(argc - 1, argv + 1);
    if (!strcmp(cmd, "forward")) {
        for (int i = 2; i + 1 < argc; i++)
            if (!strcmp(argv[i], "--ep")) return moe_cmd_forward_ep(argc - 1, argv + 1);
        return moe_cmd_forward(argc - 1, argv + 1);
    }
    if (!strcmp(cmd, "quantize")) return moe_cmd_quantize(argc - 1, argv + 1);
    if (!strcmp(cmd, "diagnose")) return moe_cmd_diagnose(argc - 1, argv + 1);
    if (!strcmp(cmd, "audit")) return moe_cmd_audit(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) {
        int routed = route(argc - 1, argv + 1, moe_cmd_bench_cuda, moe_cmd_bench_ep);
        return routed >= 0 ? routed : moe_bench_main(argc - 1, argv + 1);
    }
    if (!strcmp(cmd, "needle")) return moe_cmd_needle(argc - 1, argv + 1);
    fprintf(stderr, "moeaudit: unknown command '%s'\n", cmd);
    fputs(main_help, stderr);
    return EXIT_USAGE;
}
