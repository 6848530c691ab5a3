/* moeaudit quantize: write a quantized copy of a BF16 checkpoint. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

static const char quantize_help[] =
    "usage: moeaudit quantize --model IN --out OUT --experts mxfp4|nvfp4|fp8 [--others fp8|none]\n"
    "                         [--e2m1 rne|ties-up|toward-zero] [--mx-scale ceil|floor]\n"
    "                         [--scale-fmt float|ue8m0] [--calib FILE]\n"
    "\n"
    "Write a quantized copy of the BF16/F16/F32 checkpoint IN to the directory OUT as the release it\n"
    "imitates writes it (names, dtypes, config and quant config files, index metadata):\n"
    "  V4 names, mxfp4     deepseek-ai/DeepSeek-V4-Flash (I8 experts + E8M0 .scale; --others fp8:\n"
    "                      attention, indexer wq_b, shared experts, MTP projections FP8 + E8M0 .scale)\n"
    "  V4 names, nvfp4     nvidia/DeepSeek-V4-Flash-NVFP4 (ModelOpt experts, moe_quant_algo NVFP4)\n"
    "  HF V3 names, fp8    deepseek-ai/DeepSeek-V3 / R1 (weight_scale_inv fp32; --scale-fmt ue8m0: V3.1)\n"
    "  HF V3 names, nvfp4  nvidia/DeepSeek-R1-FP4 (ModelOpt NVFP4; attention and MTP kept BF16)\n"
    "\n"
    "  --experts F     routed experts' format\n"
    "  --others F      shared experts and other linear layers: fp8, or none (default: kept)\n"
    "  --e2m1 R        E2M1 rounding: rne (default), ties-up, toward-zero\n"
    "  --mx-scale R    MXFP4 scale rule: ceil (default; V4, ModelOpt) or floor (OCP, ggml)\n"
    "  --scale-fmt S   HF V3 FP8 scales: float (amax / 448, V3 and R1; default) or ue8m0 (V3.1)\n"
    "  --calib FILE    NVFP4 input_scale calibration: safetensors with the MoE block inputs \"hidden\"\n"
    "                  [T, H] (+ \"input_ids\" [T]); default: 256 built-in N(0, 1) tokens\n";

int moe_cmd_quantize(int argc, char **argv) {
    const char *in = NULL, *out = NULL;
    moe_quant_opts o = {MOE_Q_NONE, MOE_Q_NONE, 0, 0};
    moe_quant_file_opts fo = {.ue8m0 = false};
    bool have_experts = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(quantize_help, stdout); return EXIT_OKAY; }
        if (i + 1 >= argc) return moe_cli_usage("quantize", "option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) in = v;
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--experts")) {
            if (!moe_qfmt_parse(v, &o.experts) || o.experts == MOE_Q_NONE)
                return moe_cli_usage("quantize", "--experts %s: expected mxfp4, nvfp4 or fp8", v);
            have_experts = true;
        } else if (!strcmp(a, "--others")) {
            if (!moe_qfmt_parse(v, &o.others) || (o.others != MOE_Q_FP8 && o.others != MOE_Q_NONE))
                return moe_cli_usage("quantize", "--others %s: expected fp8 or none", v);
        } else if (!strcmp(a, "--e2m1")) {
            if (!strcmp(v, "rne")) o.e2m1_round = 0;
            else if (!strcmp(v, "ties-up")) o.e2m1_round = 1;
            else if (!strcmp(v, "toward-zero")) o.e2m1_round = 2;
            else return moe_cli_usage("quantize", "--e2m1 %s: expected rne, ties-up or toward-zero", v);
        } else if (!strcmp(a, "--mx-scale")) {
            if (!strcmp(v, "ceil")) o.mx_scale_rule = 0;
            else if (!strcmp(v, "floor")) o.mx_scale_rule = 1;
            else return moe_cli_usage("quantize", "--mx-scale %s: expected ceil or floor", v);
        } else if (!strcmp(a, "--scale-fmt")) {
            if (!strcmp(v, "float")) fo.ue8m0 = false;
            else if (!strcmp(v, "ue8m0")) fo.ue8m0 = true;
            else return moe_cli_usage("quantize", "--scale-fmt %s: expected float or ue8m0", v);
        } else if (!strcmp(a, "--calib")) {
            fo.calib = v;
        } else return moe_cli_usage("quantize", "unknown argument %s", a);
    }
    if (!in || !out || !have_experts)
        return moe_cli_usage("quantize", "%s", "--model, --out and --experts are required");
    moe_error err;
    moe_quant_report rep;
    moe_status st = moe_quantize_checkpoint_with(in, out, &o, &fo, &rep, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    printf("layout of %s\n", rep.release);
    if (rep.calib[0])
        printf("NVFP4 input_scale calibrated on %s; %d expert(s) no token reached took the largest calibrated amax\n",
               rep.calib, rep.n_uncalibrated);
    printf("quantized %d of %d tensors (experts %s, others %s): %.3f MB -> %.3f MB (%.2f bits per weight)\n",
           rep.n_quantized, rep.n_tensors, moe_qfmt_name(o.experts), moe_qfmt_name(o.others),
           (double)rep.bytes_in / 1e6, (double)rep.bytes_out / 1e6,
           rep.n_weights ? 8.0 * (double)rep.bytes_out / (double)rep.n_weights : 0.0);
    printf("wrote %s\n", out);
    return EXIT_OKAY;
}
