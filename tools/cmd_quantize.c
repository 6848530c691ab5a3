/* moeaudit quantize: write a quantized copy of a BF16 checkpoint. */
#include "cli.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

typedef struct quant_args {
    moe_cli_common c;
    int experts, others, e2m1, mx_scale, scale_fmt;
    const char *calib;
} quant_args;

typedef quant_args A;

static const moe_cli_choice experts_choices[] = {{"mxfp4", MOE_Q_MXFP4}, {"nvfp4", MOE_Q_NVFP4}, {"fp8", MOE_Q_FP8},
                                                 {NULL, 0}};
static const moe_cli_choice others_choices[] = {{"fp8", MOE_Q_FP8}, {"none", MOE_Q_NONE}, {NULL, 0}};
static const moe_cli_choice e2m1_choices[] = {{"rne", 0}, {"ties-up", 1}, {"toward-zero", 2}, {NULL, 0}};
static const moe_cli_choice mx_choices[] = {{"ceil", 0}, {"floor", 1}, {NULL, 0}};
static const moe_cli_choice scale_fmt_choices[] = {{"float", 0}, {"ue8m0", 1}, {NULL, 0}};

static const moe_opt quant_opts[] = {
    MOE_OPT_MODEL(A, "the BF16/F16/F32 checkpoint to quantize (required)"),
    {"output", "DIR", MOE_OPT_STR, offsetof(A, c.output), 0, 0, NULL, 0,
     "directory to write the quantized checkpoint to (required; not the input)", "out"},
    {"experts", "F", MOE_OPT_CHOICE, offsetof(A, experts), 0, 0, experts_choices, 0,
     "routed experts' format: mxfp4, nvfp4 or fp8 (required)", NULL},
    {"others", "F", MOE_OPT_CHOICE, offsetof(A, others), 0, 0, others_choices, 0,
     "shared experts and the other linear layers: fp8, or none (default: kept)", NULL},
    {"e2m1", "R", MOE_OPT_CHOICE, offsetof(A, e2m1), 0, 0, e2m1_choices, 0,
     "E2M1 rounding: rne (default), ties-up, toward-zero", NULL},
    {"mx-scale", "R", MOE_OPT_CHOICE, offsetof(A, mx_scale), 0, 0, mx_choices, 0,
     "MXFP4 scale rule: ceil (default; V4, ModelOpt) or floor (OCP, ggml)", NULL},
    {"scale-fmt", "S", MOE_OPT_CHOICE, offsetof(A, scale_fmt), 0, 0, scale_fmt_choices, 0,
     "HF V3 FP8 scales: float (amax / 448, V3 and R1; default) or ue8m0 (powers of two, V3.1)", NULL},
    {"calib", "FILE", MOE_OPT_STR, offsetof(A, calib), 0, 0, NULL, 0,
     "NVFP4 input_scale calibration: safetensors with the MoE block inputs \"hidden\" [T, H]\n"
     "(+ \"input_ids\" [T]); default: 256 built-in N(0, 1) tokens", NULL},
    MOE_OPT_QUIET(A, "no summary on stdout"),
};

static int quant_main(int argc, char **argv);

const moe_cli_cmd moe_cli_quantize = {
    "quantize",
    "write an FP8 / MXFP4 / NVFP4 copy of a BF16 checkpoint in release layouts",
    "moeaudit quantize --model IN --output OUT --experts mxfp4|nvfp4|fp8 [--others fp8|none]\n"
    "                  [--e2m1 rne|ties-up|toward-zero] [--mx-scale ceil|floor]\n"
    "                  [--scale-fmt float|ue8m0] [--calib FILE] [--quiet]",
    "Write a quantized copy of the BF16/F16/F32 checkpoint IN to the directory OUT as the release it\n"
    "imitates writes it (names, dtypes, config and quant config files, index metadata):\n"
    "V4 names with --experts mxfp4: deepseek-ai/DeepSeek-V4-Flash (I8 experts + E8M0 .scale; with\n"
    "--others fp8 attention, indexer wq_b, shared experts and MTP projections FP8 + E8M0 .scale,\n"
    "compressors and indexer weights_proj kept BF16). V4 names with nvfp4:\n"
    "nvidia/DeepSeek-V4-Flash-NVFP4 (ModelOpt experts with input_scale, moe_quant_algo NVFP4).\n"
    "HF V3 names with fp8: deepseek-ai/DeepSeek-V3 / R1 (fp32 weight_scale_inv; --scale-fmt ue8m0:\n"
    "V3.1). HF V3 names with nvfp4: nvidia/DeepSeek-R1-FP4 (ModelOpt NVFP4; attention and the MTP\n"
    "layer kept BF16). NVFP4 input scales are calibrated as ModelOpt does, on --calib or built-in\n"
    "tokens.",
    quant_opts,
    (int)(sizeof quant_opts / sizeof quant_opts[0]),
    NULL,
    "Exit status: 0 success, 1 failure, 2 usage or input error (nothing is left half-written).",
    quant_main,
};

static int quant_main(int argc, char **argv) {
    quant_args a;
    memset(&a, 0, sizeof a);
    a.c = moe_cli_common_default();
    a.experts = -1;
    a.others = MOE_Q_NONE;
    int rc = moe_cli_parse(&moe_cli_quantize, argc, argv, &a, NULL);
    if (rc >= 0) return rc;
    if (!a.c.model || !a.c.output || a.experts < 0)
        return moe_cli_usage("quantize", "%s", "--model, --output and --experts are required");
    char path[PATH_MAX];
    const char *in = moe_cli_model_path(a.c.model, path, sizeof path);
    if (!in) return EXIT_USAGE;
    moe_quant_opts o = {(moe_qfmt)a.experts, (moe_qfmt)a.others, a.e2m1, a.mx_scale};
    moe_quant_file_opts fo = {.ue8m0 = a.scale_fmt == 1, .calib = a.calib};
    moe_error err;
    moe_quant_report rep;
    moe_status st = moe_quantize_checkpoint_with(in, a.c.output, &o, &fo, &rep, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    if (!a.c.quiet) {
        printf("layout of %s\n", rep.release);
        if (rep.calib[0])
            printf("NVFP4 input_scale calibrated on %s; %d expert(s) no token reached took the largest calibrated "
                   "amax\n", rep.calib, rep.n_uncalibrated);
        printf("quantized %d of %d tensors (experts %s, others %s): %.3f MB -> %.3f MB (%.2f bits per weight)\n",
               rep.n_quantized, rep.n_tensors, moe_qfmt_name(o.experts), moe_qfmt_name(o.others),
               (double)rep.bytes_in / 1e6, (double)rep.bytes_out / 1e6,
               rep.n_weights ? 8.0 * (double)rep.bytes_out / (double)rep.n_weights : 0.0);
        printf("wrote %s\n", a.c.output);
    }
    return EXIT_OKAY;
}
