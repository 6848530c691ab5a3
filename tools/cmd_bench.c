/*
 * moeaudit bench: one option table for the three timings (the CPU experts,
 * bench/bench.c; --device cuda, cmd_cuda.c; --ep N under mpirun, cmd_ep.c),
 * parsed and checked once here. Options of another mode are refused.
 */
#include "cli.h"
#include "bench.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define M_CPU (1u << MOE_BENCH_CPU)
#define M_CUDA (1u << MOE_BENCH_CUDA)
#define M_EP (1u << MOE_BENCH_EP)
#define M_LIN (1u << MOE_BENCH_LINEAR)
#define M_LAY (1u << MOE_BENCH_LAYER)
#define M_WR (1u << MOE_BENCH_WRITE)
#define M_TIMED (M_CPU | M_CUDA | M_EP | M_LIN | M_LAY)

typedef moe_cli_bench_args A;

static const moe_cli_choice device_choices[] = {{"cpu", MOE_DEV_CPU}, {"cuda", MOE_DEV_CUDA}, {NULL, 0}};
static const moe_cli_choice clock_choices[] = {{"wall", 0}, {"cpu", 1}, {NULL, 0}};
static const moe_cli_choice gpath_choices[] = {{"auto", MOE_GPATH_AUTO}, {"gemv", MOE_GPATH_GEMV},
                                               {"gemv-f32", MOE_GPATH_GEMV_F32}, {"grouped", MOE_GPATH_GROUPED},
                                               {"mma", MOE_GPATH_MMA}, {"wgmma", MOE_GPATH_WGMMA},
                                               {"wgmma-cp", MOE_GPATH_WGMMA_CP}, {"wgmma-pd", MOE_GPATH_WGMMA_PD},
                                               {"wgmma-bf16", MOE_GPATH_WGMMA_BF16},
                                               {NULL, 0}};

static const moe_opt bench_opts[] = {
    {"device", "D", MOE_OPT_CHOICE, offsetof(A, device), 0, 0, device_choices, 0,
     "cpu (default) or cuda: time the GPU kernels, torch._grouped_mm beside them", NULL},
    {"ep", "N", MOE_OPT_INT, offsetof(A, ep), 1, 1 << 20, NULL, M_EP,
     "expert parallelism over N MPI ranks (mpirun -np N moeaudit bench --ep N): route,\n"
     "dispatch, compute and combine times, bytes between ranks per token", NULL},
    {"shape", "S", MOE_OPT_STR, offsetof(A, shape), 0, 0, NULL, M_CPU | M_CUDA,
     "v4flash (H 4096, I 2048, E 256, K 6; default) or v3 (H 7168, I 2048, E 256, K 8)", NULL},
    {"weights", "LIST", MOE_OPT_STR, offsetof(A, weights), 0, 0, NULL, M_CPU | M_CUDA,
     "comma list of bf16, fp8, mxfp4, nvfp4 (default: all four on the CPU,\n"
     "mxfp4,bf16 on the GPU)", NULL},
    {"act", "LIST", MOE_OPT_STR, offsetof(A, acts), 0, 0, NULL, M_CPU | M_CUDA,
     "activations: comma list of f32 (as given), bf16 (the vdpbf16ps path where the\n"
     "CPU has AVX512_BF16; its compute floor is the measured vdpbf16ps peak), nvfp4 (W4A4:\n"
     "E2M1 + UE4M3 per 16 with static input scales before each GEMM; the quantization is\n"
     "timed, the GEMM is fp32); default f32.\n"
     "--device cuda: bf16 (default), fp8", NULL},
    {"linear", NULL, MOE_OPT_FLAG, offsetof(A, linear), 0, 0, NULL, M_LIN,
     "time the whole model's dense linears at V4-Flash shapes instead (moe_linear_f64: the\n"
     "float64 GEMM with on-the-fly dequant; moe_linear_f32: the kernel table), each row beside\n"
     "the memory floor and the float64 / float32 FMA peak measured in the same run", NULL},
    {"layer-cost", NULL, MOE_OPT_FLAG, offsetof(A, layer_cost), 0, 0, NULL, M_LAY,
     "what one V4-Flash layer (sliding, CSA, HCA) costs on a T-token prompt (--tokens T,\n"
     "default 4096), float64 and float32, by part: measured unit costs times exact counts", NULL},
    {"write-v4flash", "DIR", MOE_OPT_STR, offsetof(A, write_v4flash), 0, 0, NULL, M_WR,
     "write a synthetic checkpoint in the V4-Flash release layout at full shapes (one layer\n"
     "per --ratios entry, random codes scaled for unit-RMS outputs; about 3.5 GiB per layer\n"
     "with 256 experts) for timing `moeaudit forward` end to end", NULL},
    {"tokens", "LIST", MOE_OPT_STR, offsetof(A, tokens), 0, 0, NULL, M_TIMED,
     "comma list of T (default 1,16,128 on the CPU; 1,16,128,1024,4096,8192 on the GPU;\n"
     "1,16,128,1024 with --ep, split over the ranks; 1,16,256,4096 with --linear);\n"
     "--layer-cost: one prompt length (default 4096, at least 128)", NULL},
    {"iters", "N", MOE_OPT_INT, offsetof(A, iters), 1, 100000, NULL, M_TIMED,
     "timed iterations per row (default: by T on the CPU and GPU and with --linear, 5 with\n"
     "--ep, 3 repetitions of each unit cost with --layer-cost)", NULL},
    {"shapes", "LIST", MOE_OPT_STR, offsetof(A, shapes), 0, 0, NULL, M_LIN,
     "rows to time: comma list of row numbers (see the table) or layer sets: all (every\n"
     "layer), csa, hca (the compressed layers' extras), model (the LM head); default every row", NULL},
    {"max-gflop", "G", MOE_OPT_NUM, offsetof(A, max_gflop), 0, 0, NULL, M_LIN,
     "skip rows whose one call exceeds G GFLOP (default 1500: skips the LM head at T=4096,\n"
     "4.3 TFLOP per call)", NULL},
    {"clock", "C", MOE_OPT_CHOICE, offsetof(A, clock), 0, 0, clock_choices, M_LIN | M_LAY,
     "wall (default) or cpu: time rows and peaks by process CPU time / threads, for a machine\n"
     "shared with other work (the bandwidth probe stays on the wall clock)", NULL},
    {"ratios", "LIST", MOE_OPT_STR, offsetof(A, ratios), 0, 0, NULL, M_WR,
     "compress ratio of each layer of --write-v4flash: 0 sliding, 4 CSA, 128 HCA (default\n"
     "0,4,128; layer 0 is hash-routed)", NULL},
    {"vocab", "V", MOE_OPT_INT, offsetof(A, vocab), 1, 1 << 24, NULL, M_WR,
     "vocabulary of --write-v4flash (default 129280)", NULL},
    {"seed", "S", MOE_OPT_INT, offsetof(A, seed), 0, 1L << 31, NULL, M_WR,
     "random seed of --write-v4flash (default 1)", NULL},
    MOE_OPT_THREADS(A),
    {"experts", "N", MOE_OPT_INT, offsetof(A, experts), 6, 4096, NULL, M_CPU | M_WR,
     "experts to materialise (default: all E, capped by --max-gib); --write-v4flash: routed\n"
     "experts per layer (default 256)", NULL},
    {"max-gib", "G", MOE_OPT_NUM, offsetof(A, max_gib), 0, 0, NULL, M_CPU,
     "cap on the materialised working set in GiB (default 8)", NULL},
    {"isa", "I", MOE_OPT_STR, offsetof(A, c.isa), 0, 0, NULL, M_CPU | M_EP | M_LIN | M_LAY,
     "CPU kernel table: ref, avx2 or avx512 (default: the best this CPU has, or MOE_ISA)", NULL},
    {"path", "P", MOE_OPT_CHOICE, offsetof(A, gpath), 0, 0, gpath_choices, M_CUDA,
     "GPU expert kernels: auto (default), gemv (small T), gemv-f32, grouped (FP4, moderate T),\n"
     "wgmma (grouped GEMMs on Hopper's wgmma, TMA loads, FP8/FP4 weights decoded beside\n"
     "the MMAs; FP8 weights with --act fp8 or fp8-f32scale on the FP8 tensor cores),\n"
     "wgmma-bf16 (wgmma with bf16 operands: FP8 activations rounded, then multiplied as\n"
     "bf16), wgmma-pd (the same with the decode in the producer warpgroup), wgmma-cp\n"
     "(wgmma-pd with cp.async loads), mma (the older mma.sync GEMMs)", NULL},
    {"no-peer", NULL, MOE_OPT_FLAG, offsetof(A, no_peer), 0, 0, NULL, M_CUDA,
     "skip the torch._grouped_mm peer (bench/cuda/torch_peer.py)", NULL},
    {"no-graphs", NULL, MOE_OPT_FLAG, offsetof(A, no_graphs), 0, 0, NULL, M_CUDA,
     "launch each iteration's kernels directly (default: replay one CUDA graph per\n"
     "routing set, so host launch gaps stay out of the device time)", NULL},
    {"model", "DIR", MOE_OPT_STR, offsetof(A, c.model), 0, 0, NULL, M_EP,
     "checkpoint to time (default: the bundled dsv4-tiny)", NULL},
    {"synth", "DIR", MOE_OPT_STR, offsetof(A, synth), 0, 0, NULL, M_EP,
     "write (once) and time a V4-Flash-shaped checkpoint: H 4096, I 2048, K 6,\n"
     "--synth-experts E (16), one hash and one top-k layer", NULL},
    {"synth-experts", "E", MOE_OPT_INT, offsetof(A, synth_experts), 6, 4096, NULL, M_EP,
     "routed experts of --synth (default 16)", NULL},
    {"synth-inter", "I", MOE_OPT_INT, offsetof(A, synth_inter), 1, 65536, NULL, M_EP,
     "moe_intermediate_size of --synth (default 2048; smaller times V4-Flash traffic\n"
     "without the cost of its experts)", NULL},
    {"layer", "N", MOE_OPT_INT, offsetof(A, c.layer), 0, 1000000, NULL, M_EP,
     "layer to time (default: the last)", NULL},
    {"precision", "P", MOE_OPT_STR, offsetof(A, c.precision), 0, 0, NULL, M_EP | M_LIN,
     "f32 (default) or ref; --linear: a comma list of ref (float64), f32 (default both)", NULL},
    {"placement", "FILE", MOE_OPT_STR, offsetof(A, placement), 0, 0, NULL, M_EP,
     "experts per rank: \"EXPERT RANK\" lines or a JSON array of ranks", NULL},
    {"round", "R", MOE_OPT_INT, offsetof(A, round), 1, 1 << 30, NULL, M_EP,
     "tokens per dispatch round (default: all in one round)", NULL},
    {"json", "FILE", MOE_OPT_OUT, offsetof(A, c.json), 0, 0, NULL, M_CPU | M_CUDA,
     "also write the rows as JSON ('-': stdout, the progress then goes to stderr)", NULL},
};

static const char *const bench_modes[] = {"the CPU bench", "--device cuda", "--ep N", "--linear", "--layer-cost",
                                          "--write-v4flash", NULL};

static int bench_main(int argc, char **argv);

const moe_cli_cmd moe_cli_bench = {
    "bench",
    "time the routed experts against the memory and compute floors (--device cuda, --ep N)",
    "moeaudit bench [--shape S] [--weights LIST] [--act LIST] [--tokens LIST] [--threads N]\n"
    "               [--experts N] [--iters N] [--isa I] [--max-gib G] [--json FILE]\n"
    "moeaudit bench --device cuda [--shape S] [--weights LIST] [--act LIST] [--tokens LIST]\n"
    "               [--iters N] [--path P] [--no-peer] [--no-graphs] [--json FILE]\n"
    "mpirun -np N moeaudit bench --ep N [--model DIR | --synth DIR] [--layer N] [--tokens LIST]\n"
    "               [--iters N] [--precision P] [--placement FILE] [--round R]\n"
    "moeaudit bench --linear [--precision LIST] [--tokens LIST] [--shapes LIST] [--threads N]\n"
    "               [--iters N] [--isa I] [--max-gflop G] [--clock C]\n"
    "moeaudit bench --layer-cost [--tokens T] [--threads N] [--isa I] [--iters N] [--clock C]\n"
    "moeaudit bench --write-v4flash DIR [--ratios LIST] [--experts E] [--vocab V] [--seed S]",
    "Time the routed experts of one MoE block (gate, up, down for all T x K assignments) and print\n"
    "each row beside its memory and compute floors measured in the same run: memory floor = bytes\n"
    "of the touched experts' weights (stored size, scales included) and activations over the\n"
    "measured read bandwidth; compute floor = 2 T K 3 H I over the measured peak of the\n"
    "arithmetic the row uses. Expert ids are drawn fresh each iteration (distinct per token,\n"
    "uniform over the materialised experts). --linear times the whole model's dense linears the\n"
    "same way; --layer-cost prices one V4-Flash layer on a prompt by part; --write-v4flash writes a\n"
    "V4-Flash-shaped checkpoint for timing forward. See docs/performance.md for recorded runs.",
    bench_opts,
    (int)(sizeof bench_opts / sizeof bench_opts[0]),
    bench_modes,
    "Exit status: 0 success, 1 failure, 2 usage error.",
    bench_main,
};

static int check_list(const char *opt, const char *list, const char *const *names, const char *expect) {
    char buf[256];
    char *parts[32];
    snprintf(buf, sizeof buf, "%s", list);
    int n = moe_cli_split(buf, parts, 32);
    if (n < 0) return moe_cli_usage("bench", "%s: expected a comma list without empty items", opt);
    for (int i = 0; i < n; i++) {
        bool ok = false;
        for (int k = 0; names[k] && !ok; k++) ok = !strcmp(parts[i], names[k]);
        if (!ok) {
            fprintf(stderr, "moeaudit bench: %s: '%s' is not one of %s\nTry 'moeaudit bench --help'.\n", opt, parts[i],
                    expect);
            return EXIT_USAGE;
        }
    }
    return -1;
}

/* --linear: the precision list in the one vocabulary (ref = float64). */
static int bench_linear(const moe_cli_bench_args *a) {
    moe_bench_linear_opts o;
    memset(&o, 0, sizeof o);
    if (!a->c.precision) o.f64 = o.f32 = true;
    else {
        char buf[128];
        char *parts[8];
        snprintf(buf, sizeof buf, "%s", a->c.precision);
        int n = moe_cli_split(buf, parts, 8);
        if (n <= 0) return moe_cli_usage("bench", "--precision %s: expected a comma list of ref, f32", a->c.precision);
        for (int i = 0; i < n; i++) {
            const moe_cli_prec *p = moe_cli_prec_find(parts[i], MOE_PU_BLOCK);
            if (!p) return moe_cli_prec_bad("bench", "precision", parts[i], MOE_PU_BLOCK);
            if (!strcmp(p->name, "ref")) o.f64 = true;
            else o.f32 = true;
        }
    }
    static const int64_t default_tokens[] = {1, 16, 256, 4096};
    o.ntok = a->ntok > 0 ? a->ntok : 4;
    for (int i = 0; i < o.ntok; i++) o.tokens[i] = a->ntok > 0 ? a->tok[i] : default_tokens[i];
    o.shapes = a->shapes;
    o.threads = (int)a->c.threads;
    o.iters = (int)a->iters;
    if (!(a->max_gflop > 0)) return moe_cli_usage("bench", "%s", "--max-gflop: expected a positive count of GFLOP");
    o.max_gflop = a->max_gflop;
    o.cpu_clock = a->clock == 1;
    o.isa = a->isa;
    return moe_bench_linear(&o);
}

static int bench_main(int argc, char **argv) {
    moe_cli_bench_args a;
    memset(&a, 0, sizeof a);
    a.c = moe_cli_common_default();
    a.synth_experts = 16;
    a.synth_inter = 2048;
    a.max_gib = 8.0;
    a.precision = MOE_PREC_F32;
    a.max_gflop = 1500;
    a.vocab = 129280;
    a.seed = 1;
    bool seen[MOE_CLI_MAX_OPTS];
    int rc = moe_cli_parse(&moe_cli_bench, argc, argv, &a, seen);
    if (rc >= 0) return rc;
    int nsel = (a.device == MOE_DEV_CUDA) + (a.ep > 0) + a.linear + a.layer_cost + (a.write_v4flash != NULL);
    if (nsel > 1)
        return moe_cli_usage("bench", "%s",
                             "--device cuda, --ep, --linear, --layer-cost and --write-v4flash cannot be combined");
    int mode = a.device == MOE_DEV_CUDA ? MOE_BENCH_CUDA
               : a.ep > 0           ? MOE_BENCH_EP
               : a.linear           ? MOE_BENCH_LINEAR
               : a.layer_cost       ? MOE_BENCH_LAYER
               : a.write_v4flash    ? MOE_BENCH_WRITE
                                    : MOE_BENCH_CPU;
    if ((rc = moe_cli_check_modes(&moe_cli_bench, seen, mode)) >= 0) return rc;
    if (a.shape && strcmp(a.shape, "v4flash") && strcmp(a.shape, "v3"))
        return moe_cli_usage("bench", "--shape %s: expected v4flash or v3", a.shape);
    static const char *const wnames[] = {"bf16", "fp8", "mxfp4", "nvfp4", NULL};
    if (a.weights && (rc = check_list("--weights", a.weights, wnames, "bf16, fp8, mxfp4, nvfp4")) >= 0) return rc;
    if (a.tokens) {
        char buf[512];
        char *parts[16];
        snprintf(buf, sizeof buf, "%s", a.tokens);
        int n = moe_cli_split(buf, parts, 16);
        for (int i = 0; i < n; i++) {
            long v;
            if (!moe_cli_parse_int(parts[i], 1, 1L << 24, &v)) n = -1;
            else a.tok[i] = v;
        }
        if (n <= 0) return moe_cli_usage("bench", "--tokens %s: expected a comma list of up to 16 positive counts", a.tokens);
        a.ntok = n;
    }
    if (a.max_gib <= 0) {
        char v[32];
        snprintf(v, sizeof v, "%g", a.max_gib);
        return moe_cli_usage("bench", "--max-gib %s: expected a positive size in GiB", v);
    }
    if ((rc = moe_cli_apply_common("bench", &a.c, &a.isa)) >= 0) return rc;

    if (mode == MOE_BENCH_LINEAR) return bench_linear(&a);
    if (mode == MOE_BENCH_LAYER) {
        if (a.ntok > 1) return moe_cli_usage("bench", "--tokens %s: --layer-cost takes one prompt length", a.tokens);
        if (a.ntok == 1 && a.tok[0] < 128)
            return moe_cli_usage("bench", "--tokens %s: --layer-cost needs a prompt of at least 128 tokens", a.tokens);
        moe_bench_layer_opts o = {a.ntok ? a.tok[0] : 4096, (int)a.c.threads, a.iters ? (int)a.iters : 3,
                                  a.clock == 1, a.isa};
        return moe_bench_layer_cost(&o);
    }
    if (mode == MOE_BENCH_WRITE) {
        moe_bench_synth_opts o = {a.write_v4flash, a.ratios, a.experts ? (int)a.experts : 256, (int)a.vocab,
                                  (uint64_t)a.seed};
        return moe_bench_write_v4flash(&o);
    }
    if (mode == MOE_BENCH_CUDA) {
        static const char *const gacts[] = {"bf16", "fp8", NULL};
        if (a.acts && (rc = check_list("--act", a.acts, gacts, "bf16, fp8 (on the GPU)")) >= 0) return rc;
        return moe_bench_cuda(&a);
    }
    if (mode == MOE_BENCH_EP) {
        if (a.c.precision) {
            const moe_cli_prec *p = moe_cli_prec_find(a.c.precision, MOE_PU_BLOCK);
            if (!p) return moe_cli_prec_bad("bench", "precision", a.c.precision, MOE_PU_BLOCK);
            a.precision = !strcmp(p->name, "ref") ? MOE_PREC_REF : MOE_PREC_F32;
        }
        char model[PATH_MAX];
        if (!a.synth && !(a.model = moe_cli_model_path(a.c.model, model, sizeof model))) return EXIT_USAGE;
        return moe_bench_ep(&a);
    }

    moe_bench_opts o;
    memset(&o, 0, sizeof o);
    o.shape = a.shape ? a.shape : "v4flash";
    o.weights = a.weights ? a.weights : "mxfp4,nvfp4,fp8,bf16";
    {
        char buf[256];
        char *parts[8];
        snprintf(buf, sizeof buf, "%s", a.acts ? a.acts : "f32");
        int n = moe_cli_split(buf, parts, 8);
        if (n < 0) return moe_cli_usage("bench", "--act %s: expected a comma list of f32, bf16, nvfp4", a.acts);
        for (int i = 0; i < n; i++) {
            const moe_cli_prec *p = moe_cli_prec_find(parts[i], MOE_PU_CPU_BENCH);
            if (!p) return moe_cli_prec_bad("bench", "act", parts[i], MOE_PU_CPU_BENCH);
            if (!strcmp(p->name, "bf16")) o.act_bf16 = true;
            else if (!strcmp(p->name, "nvfp4")) o.act_nvfp4 = true;
            else o.act_f32 = true; /* f32 and exact: the activations as given, in f32 */
        }
    }
    static const int64_t default_tokens[] = {1, 16, 128};
    o.ntok = a.ntok > 0 ? a.ntok : 3;
    for (int i = 0; i < o.ntok; i++) o.tokens[i] = a.ntok > 0 ? a.tok[i] : default_tokens[i];
    o.iters = (int)a.iters;
    o.experts = a.experts;
    o.max_gib = a.max_gib;
    o.isa = a.isa;
    moe_out_file *jh = NULL;
    FILE *json = a.c.json ? moe_cli_open_out(a.c.json, &jh) : NULL;
    if (a.c.json && !json) return EXIT_FAIL;
    rc = moe_bench_cpu(&o, json == stdout ? stderr : stdout, json);
    if (json && rc != EXIT_OKAY) moe_out_abort(jh); /* a failed bench keeps the old report */
    else if (json && !moe_cli_close_out(json, jh, a.c.json)) rc = EXIT_FAIL;
    return rc;
}
