/*
 * The CLI's one grammar and its shared helpers.
 *
 * Every command is a moe_cli_cmd: a name, help prose and one option table
 * (moe_opt [n]). One parser (moe_cli_parse, tools/args.c) reads every
 * command's argv against its table: `--opt value` and `--opt=value` alike,
 * `-` for stdout in every output-file option, an unknown option or a bad
 * value named in a usage error (exit 2). The same table prints `--help`,
 * `moeaudit help CMD` and the man page, so help, man page and parser cannot
 * disagree. The options several commands share (--model --layer(s) --input
 * --output --precision --act --threads --isa --json --html --quiet) are
 * defined once below (MOE_OPT_* macros) and land in moe_cli_common, the
 * first member of every command's argument struct.
 *
 * Precision names are one vocabulary (moe_cli_prec_*): `fp8` is E4M3 with a
 * power-of-two scale (V3.1+, V4) everywhere, `fp8-f32scale` the fp32 scale
 * (V3), `f32` single precision, `ref` float64.
 *
 * The CLI includes the public headers (include/) only; it is the only place
 * where printing to stdout/stderr and exit codes live.
 */
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include "moeaudit.h"

#include <stddef.h>
#include <stdio.h>

enum { EXIT_OKAY = 0, EXIT_FAIL = 1, EXIT_USAGE = 2 };

/* ------------------------------------------------------------ grammar */

typedef enum moe_opt_kind {
    MOE_OPT_FLAG,   /* bool; takes no value */
    MOE_OPT_STR,    /* const char *; any non-empty value */
    MOE_OPT_OUT,    /* const char *; an output file, "-" = stdout */
    MOE_OPT_INT,    /* long in [lo, hi] */
    MOE_OPT_NUM,    /* double, finite */
    MOE_OPT_CHOICE, /* int: the value of the name given, from choices */
} moe_opt_kind;

/* One name of a MOE_OPT_CHOICE option and the int it stores. */
typedef struct moe_cli_choice {
    const char *name;
    int value;
} moe_cli_choice;

/* One option of a command's table. */
typedef struct moe_opt {
    const char *name;              /* long name without "--" */
    const char *meta;              /* value placeholder ("DIR"); NULL for flags */
    moe_opt_kind kind;
    size_t off;                    /* offset of the destination in the command's args struct */
    long lo, hi;                   /* MOE_OPT_INT bounds */
    const moe_cli_choice *choices; /* MOE_OPT_CHOICE, {NULL, 0}-terminated */
    unsigned modes;                /* bit set of the command's modes it applies to; 0: all */
    const char *help;              /* lines separated by '\n' */
    const char *alias;             /* an older spelling also accepted, or NULL */
} moe_opt;

/* One command. */
typedef struct moe_cli_cmd {
    const char *name;          /* "run" */
    const char *summary;       /* one line for the command list */
    const char *synopsis;      /* usage lines, '\n'-separated, without the leading "usage: " */
    const char *about;         /* what it does (paragraphs) */
    const moe_opt *opts;
    int n_opts;
    const char *const *modes;  /* names of mode bits 0, 1, ... ("--device cuda"), NULL-terminated */
    const char *footer;        /* exit status and notes */
    int (*main)(int argc, char **argv);
} moe_cli_cmd;

#define MOE_CLI_MAX_OPTS 64

/* Parse argv[1 .. argc-1] (argv[0] is the command name) into args, a struct
 * laid out as cmd->opts' offsets say; defaults must be set before. seen
 * [cmd->n_opts] (may be NULL) records which options were given. Returns -1
 * when the command should run, EXIT_OKAY after printing --help to stdout, or
 * EXIT_USAGE after naming the bad option or value on stderr. */
int moe_cli_parse(const moe_cli_cmd *cmd, int argc, char **argv, void *args, bool *seen);
/* Refuse (EXIT_USAGE, message names the option and the modes it needs) any
 * option in seen that does not apply to mode bit `mode`; -1 when all do. */
int moe_cli_check_modes(const moe_cli_cmd *cmd, const bool *seen, int mode);
/* Index of option `name` in cmd's table, or -1. */
int moe_cli_opt_index(const moe_cli_cmd *cmd, const char *name);
/* --help text of cmd. */
void moe_cli_print_help(FILE *f, const moe_cli_cmd *cmd);
/* The man page (roff) of every command in cmds [n]. */
void moe_cli_print_man(FILE *f, const moe_cli_cmd *const *cmds, int n);

/* The commands (tools/cmd_<name>.c). */
extern const moe_cli_cmd moe_cli_run, moe_cli_forward, moe_cli_audit, moe_cli_bench, moe_cli_diagnose,
    moe_cli_needle, moe_cli_bisect, moe_cli_quantize, moe_cli_inspect;

/* Print "moeaudit <cmd>: <fmt with arg>" and the --help hint; return 2. */
int moe_cli_usage(const char *cmd, const char *fmt, const char *arg);
/* Exit code for a library status: 2 for statuses that mean the input (files,
 * flags) is wrong, 1 otherwise. */
int moe_cli_exit_code(moe_status s);
/* Print "moeaudit: <status>: <message>" and return its exit code. */
int moe_cli_fail(moe_status s, const moe_error *err);
bool moe_cli_parse_int(const char *s, long lo, long hi, long *out);
bool moe_cli_parse_double(const char *s, double *out);
/* Split a comma list in place into parts [<= max]; returns the count, or -1
 * when there are more than max or an empty item. */
int moe_cli_split(char *s, char **parts, int max);

/* -------------------------------------------------- the shared options */

/* What every command's args struct starts with (as member `c`). */
typedef struct moe_cli_common {
    const char *model;     /* --model DIR (or a bundled checkpoint's name); NULL: the command's default */
    long layer;            /* --layer N; -1: not given */
    const char *layers;    /* --layers LIST|all */
    const char *input;     /* --input FILE */
    const char *output;    /* --output FILE, "-" = stdout */
    const char *precision; /* --precision NAME (checked by the command: moe_cli_prec_*) */
    const char *act;       /* --act NAME */
    long threads;          /* --threads N; 0: OpenMP's default */
    const char *isa;       /* --isa ref|avx2|avx512 */
    const char *json;      /* --json FILE, "-" = stdout */
    const char *html;      /* --html FILE, "-" = stdout */
    bool quiet;            /* --quiet: no summary on stdout */
} moe_cli_common;

/* Defaults: layer -1, everything else empty. */
moe_cli_common moe_cli_common_default(void);

#define MOE_OPT_MODEL(T, help) {"model", "DIR", MOE_OPT_STR, offsetof(T, c.model), 0, 0, NULL, 0, help, NULL}
#define MOE_OPT_LAYER(T, help) {"layer", "N", MOE_OPT_INT, offsetof(T, c.layer), 0, 1000000, NULL, 0, help, NULL}
#define MOE_OPT_LAYERS(T, help) {"layers", "LIST", MOE_OPT_STR, offsetof(T, c.layers), 0, 0, NULL, 0, help, NULL}
#define MOE_OPT_INPUT(T, help) {"input", "FILE", MOE_OPT_STR, offsetof(T, c.input), 0, 0, NULL, 0, help, NULL}
#define MOE_OPT_OUTPUT(T, help) {"output", "FILE", MOE_OPT_OUT, offsetof(T, c.output), 0, 0, NULL, 0, help, NULL}
#define MOE_OPT_PRECISION(T, help) \
    {"precision", "P", MOE_OPT_STR, offsetof(T, c.precision), 0, 0, NULL, 0, help, NULL}
#define MOE_OPT_ACT(T, help) {"act", "A", MOE_OPT_STR, offsetof(T, c.act), 0, 0, NULL, 0, help, NULL}
#define MOE_OPT_THREADS(T) \
    {"threads", "N", MOE_OPT_INT, offsetof(T, c.threads), 1, 4096, NULL, 0, "OpenMP threads (default: OMP_NUM_THREADS, else all cores)", NULL}
#define MOE_OPT_ISA(T) \
    {"isa", "I", MOE_OPT_STR, offsetof(T, c.isa), 0, 0, NULL, 0, \
     "CPU kernel table: ref, avx2 or avx512 (default: the best this CPU has, or MOE_ISA)", NULL}
#define MOE_OPT_JSON(T, help) {"json", "FILE", MOE_OPT_OUT, offsetof(T, c.json), 0, 0, NULL, 0, help, NULL}
#define MOE_OPT_HTML(T, help) {"html", "FILE", MOE_OPT_OUT, offsetof(T, c.html), 0, 0, NULL, 0, help, NULL}
#define MOE_OPT_QUIET(T, help) {"quiet", NULL, MOE_OPT_FLAG, offsetof(T, c.quiet), 0, 0, NULL, 0, help, NULL}

/* Apply --threads (process-wide: the CLI runs one command) and resolve the
 * CPU kernels into *isa (may be NULL): --isa, else MOE_ISA from the
 * environment, else auto. Returns -1, or EXIT_USAGE after naming the bad or
 * unavailable ISA and what this CPU has. */
int moe_cli_apply_common(const char *cmd, const moe_cli_common *c, moe_isa *isa);
/* The CLI's default CPU kernels: MOE_ISA from the environment (unset or
 * empty: auto). An unknown or unavailable value is printed with what is
 * available and returns 2; else *isa is set and 0 returned. */
int moe_cli_isa_default(moe_isa *isa);

/* ------------------------------------------------------ precision names */

/* Where a precision name is used. */
typedef enum moe_cli_prec_use {
    MOE_PU_BLOCK = 1,   /* run/bench --precision: the MoE block's arithmetic */
    MOE_PU_ACT = 2,     /* run --act: rounding of the expert GEMMs' input activations */
    MOE_PU_GPU_ACT = 4, /* run --device cuda --act, bench --device cuda --act */
    MOE_PU_CPU_BENCH = 8, /* bench --act (CPU) */
    MOE_PU_HC = 16,     /* run --block hc_* --precision: the MHC linear */
    MOE_PU_IDX = 32,    /* needle --precisions: indexer q/k rounding */
} moe_cli_prec_use;

/* One precision name. */
typedef struct moe_cli_prec {
    const char *name;    /* canonical */
    const char *aliases; /* older spellings accepted, space-separated, or "" */
    unsigned uses;       /* moe_cli_prec_use bits */
    const char *meaning;
} moe_cli_prec;

/* The vocabulary, {NULL}-terminated. */
extern const moe_cli_prec moe_cli_precs[];
/* The entry named s (canonical or alias) if it is valid for `use`, else NULL. */
const moe_cli_prec *moe_cli_prec_find(const char *s, moe_cli_prec_use use);
/* "ref or f32": the names valid for `use`, for messages. */
const char *moe_cli_prec_list(moe_cli_prec_use use, char *buf, size_t n);
/* Usage error for a bad precision value of option `opt`. */
int moe_cli_prec_bad(const char *cmd, const char *opt, const char *value, moe_cli_prec_use use);

/* ------------------------------------------------------ files and data */

/* Open path for writing ("-": stdout, *h = NULL). A file is written
 * atomically through the library's writer (moe_out_open: an exclusive
 * random temporary beside it, renamed over path by moe_cli_close_out): a
 * failure leaves the old report intact and no temporary behind. NULL and a
 * message naming path and cause on failure. */
FILE *moe_cli_open_out(const char *path, moe_out_file **h);
/* A private temporary path "<TMPDIR or /tmp>/moeaudit-XXXXXX/<name>" for an
 * output that goes to stdout after it is complete: the directory is made by
 * mkdtemp (a fresh random name, mode 0700), so nothing planted beforehand is
 * followed or read. False with a message on failure. Undo with
 * moe_cli_private_tmp_done (removes the file and the directory). */
bool moe_cli_private_tmp(char *buf, size_t n, const char *name);
/* #12 item 9: an output must not replace an input. For each of outs [n_out]
 * (NULL and "-" skipped): refused when it is the same file (device and
 * inode, whatever the spelling or link) as one of inputs [n_in] (NULL
 * skipped) or as any file directly in model_dir (config.json, the shard
 * index, the shards; NULL: no model). Returns -1 when every output is new
 * or unrelated, else 2 after a message naming both paths. */
int moe_cli_check_outputs(const char *cmd, const char *const *outs, int n_out, const char *const *inputs, int n_in,
                          const char *model_dir);
void moe_cli_private_tmp_done(const char *path);
/* Finish what moe_cli_open_out returned: stdout is flushed, a file is
 * committed (or dropped when a write failed); returns false with a message
 * naming path and cause when anything failed. */
bool moe_cli_close_out(FILE *f, moe_out_file *h, const char *path);
/* An output that could not be written (disk full, I/O error): the message,
 * and exit 1 whatever the status (2 is for usage and input errors). */
int moe_cli_fail_out(moe_status s, const moe_error *err);
/* More than one of paths [n] is "-"? Then print a usage error for cmd and
 * return EXIT_USAGE; else -1. */
int moe_cli_one_stdout(const char *cmd, const char *const *paths, const char *const *names, int n);
/* Does any of paths [n] write to stdout? */
bool moe_cli_any_stdout(const char *const *paths, int n);
/* Where a command's human-readable text goes: stdout; stderr when a report
 * goes to stdout ("-"), so stdout carries the report alone; NULL with
 * --quiet. */
FILE *moe_cli_text(bool quiet, bool report_on_stdout);

/* Where the bundled checkpoints are: $MOEAUDIT_DATA, else beside the
 * executable as installed (<bindir>/../share/moeaudit) or in the build tree
 * (<exe dir>/share/moeaudit). Writes the directory to buf; false when none
 * exists. */
bool moe_cli_data_dir(char *buf, size_t n);
/* The checkpoint a --model value names: an existing path as given, else a
 * bundled checkpoint of that name (dsv4-tiny, dsv3-tiny, dsv3-tiny-fp8);
 * NULL resolves to the default, dsv4-tiny. Returns buf, or NULL after a
 * message saying where it looked. */
const char *moe_cli_model_path(const char *model, char *buf, size_t n);
#define MOE_CLI_DEFAULT_MODEL "dsv4-tiny"

/* JSON documents the CLI writes carry these (docs/schemas/). */
#define MOE_CLI_SCHEMA_VERSION 1
#define MOE_CLI_TOOL "moeaudit " MOEAUDIT_VERSION

struct cJSON;
/* A report's header object (schema_version, tool, report); NULL when out of
 * memory. The caller adds its own fields and owns the object. */
struct cJSON *moe_cli_report_head(const char *report);
/* head, with the library's JSON document lib_json merged under it (a key
 * the header already has is kept), printed. Consumes head and lib_json
 * (either may be NULL); NULL when either is missing, lib_json does not
 * parse, or memory runs out. */
char *moe_cli_report_print(struct cJSON *head, char *lib_json);

/* ---------------------------------------------------------------- inputs */

/* The built-in input of `run` (every device and parallel mode draws the
 * same tokens): splitmix64 from this seed. */
#define MOE_CLI_SEED 20261130u
uint64_t moe_cli_mix(uint64_t *s);
/* hidden [T, H] ~ N(0, 1) (sum of 4 uniforms), ids [T] uniform < vocab. */
void moe_cli_fill_input(uint64_t seed, int64_t T, int H, int vocab, double *hidden, int64_t *ids);

typedef struct moe_cli_input {
    int64_t T;
    int H;
    double *hidden;     /* [T, H] */
    int64_t *ids;       /* [T] or NULL */
} moe_cli_input;
/* Return exit codes; messages (naming file, tensor, value) on stderr. */
int moe_cli_builtin_input(moe_cli_input *in, int64_t T, int H, int vocab);
int moe_cli_read_input(const char *path, int H, moe_cli_input *in);
/* The input of one layer: tensors layer<N>.hidden and layer<N>.input_ids
 * when the file has them, else hidden and input_ids. */
int moe_cli_read_layer_input(const char *path, int layer, int H, moe_cli_input *in);
void moe_cli_input_free(moe_cli_input *in);

/* --------------------------------------------------------------- outputs */

/* The output tensors of `run`, collected and written atomically. */
#define MOE_CLI_MAX_TENSORS 64
typedef struct moe_cli_writer {
    moe_st_entry e[MOE_CLI_MAX_TENSORS];
    char names[MOE_CLI_MAX_TENSORS][64];
    void *bufs[MOE_CLI_MAX_TENSORS];
    int n;
} moe_cli_writer;
/* One tensor [d0, d1]: from src (F64, or converted to F32 when f32) or from
 * isrc (I32). src/isrc must outlive the write. Returns 0 or -1. */
int moe_cli_writer_add(moe_cli_writer *w, const char *prefix, const char *name, bool f32, const double *src,
                       const int32_t *isrc, int64_t d0, int64_t d1);
/* router_logits, topk_ids, topk_weights, eff_weights, routed_out, shared_out, moe_out. */
int moe_cli_writer_add_block(moe_cli_writer *w, const char *prefix, const moe_block_out *o, bool f32);
/* Write the tensors to path atomically when rc is still EXIT_OKAY and path
 * is set ("-": the safetensors bytes to stdout), saying so on stdout unless
 * quiet, or the error on stderr; then free them. Returns the exit code. */
int moe_cli_writer_finish(moe_cli_writer *w, const char *path, int rc, bool quiet);
void moe_cli_writer_free(moe_cli_writer *w);
/* Write entries [n] as safetensors to path, or to stdout for "-" (through a
 * temporary file, so a failure writes nothing). */
moe_status moe_cli_st_write(const char *path, const moe_st_entry *e, size_t n, const char *const *meta,
                            moe_error *err);

/* ---------------------------------------------------- run and bench */

/* `moeaudit run`, parsed once (tools/cmd_run.c) and handed to the mode's
 * implementation. */
enum { MOE_RUN_CPU, MOE_RUN_CUDA, MOE_RUN_EP, MOE_RUN_HC }; /* mode bits */
enum { MOE_BLOCK_MOE, MOE_BLOCK_HC_FFN, MOE_BLOCK_HC_ATTN };
enum { MOE_DEV_CPU, MOE_DEV_CUDA };
enum { MOE_GPATH_AUTO, MOE_GPATH_GEMV, MOE_GPATH_GEMV_F32, MOE_GPATH_GROUPED, MOE_GPATH_MMA, MOE_GPATH_WGMMA,
       MOE_GPATH_WGMMA_CP, MOE_GPATH_WGMMA_PD, MOE_GPATH_WGMMA_BF16 };

typedef struct moe_cli_run_args {
    moe_cli_common c;
    long tokens;              /* built-in input: tokens (8) */
    int block, device, gpath; /* MOE_BLOCK_*, MOE_DEV_*, MOE_GPATH_* */
    int owner;                /* moe_scale_owner */
    long ep;                  /* 0: single process */
    const char *placement;
    bool fuse_shared, check, compare, audit;
    /* resolved by cmd_run.c */
    const char *model;        /* checkpoint directory */
    moe_run_opts o;           /* precision, act, owner, fuse_shared, check */
    int hc_prec;              /* moe_hc_prec, MOE_RUN_HC */
} moe_cli_run_args;

int moe_run_cpu(const moe_cli_run_args *a);
int moe_run_hc(const moe_cli_run_args *a);
int moe_run_cuda(const moe_cli_run_args *a);  /* exit 2 without CUDA support */
int moe_run_ep(const moe_cli_run_args *a);    /* exit 2 without MPI support */

/* `moeaudit bench`, parsed once (tools/cmd_bench.c). */
enum { MOE_BENCH_CPU, MOE_BENCH_CUDA, MOE_BENCH_EP, MOE_BENCH_LINEAR, MOE_BENCH_LAYER, MOE_BENCH_WRITE }; /* mode bits */
typedef struct moe_cli_bench_args {
    moe_cli_common c;
    int device;
    long ep;
    const char *shape, *weights, *acts, *tokens; /* lists as given (NULL: the mode's default) */
    long iters, experts, synth_experts, synth_inter, round;
    double max_gib;
    int gpath;
    bool no_peer, no_graphs;
    const char *synth, *placement;
    bool linear, layer_cost;  /* --linear, --layer-cost: the dense-linear and layer-cost modes */
    const char *write_v4flash; /* --write-v4flash DIR */
    const char *shapes, *ratios;
    double max_gflop;
    int clock;                /* 0 wall, 1 process CPU time / threads */
    long vocab, seed;
    /* resolved by cmd_bench.c */
    int64_t tok[16];          /* --tokens; ntok 0: the mode's default list */
    int ntok;
    const char *model;        /* --ep: the checkpoint directory */
    moe_precision precision;  /* --ep: ref or f32 (default f32) */
    moe_isa isa;              /* --isa, else MOE_ISA, else auto */
} moe_cli_bench_args;

int moe_bench_cuda(const moe_cli_bench_args *a);
int moe_bench_ep(const moe_cli_bench_args *a);

/* `moeaudit forward`, parsed once (tools/cmd_forward.c). */
enum { MOE_FWD_ONE, MOE_FWD_EP }; /* mode bits */
typedef struct moe_cli_fwd_args {
    moe_cli_common c;
    const char *model, *input, *output, *replay, *layers_s, *chunks_s;
    moe_precision precision;
    int first, last;          /* -1: default */
    bool open_end;            /* "A.." */
    bool mtp;                 /* --layers mtp */
    int64_t chunks[64];
    int n_chunks;
    long threads, tokens;
    long ep;                  /* 0: one process */
    const char *placement;    /* --ep: expert-to-rank map, or NULL */
    moe_isa isa;              /* --isa (moe_cli_apply_common) */
} moe_cli_fwd_args;

/* A parallel driver's part in `forward` (--ep N: moe_forward_ep, tools/
 * cmd_ep.c), so that the command knows nothing of MPI. Rank 0 reads the
 * input, prints and writes --output; every rank opens the model and runs
 * the forward. Every rank calls the hooks at the same points. */
typedef struct moe_cli_fwd_par {
    int rank, size;
    void *ctx;
    /* Every rank's status agreed: the lowest failing rank's, with its message. */
    moe_status (*agree)(void *ctx, moe_status st, moe_error *err);
    /* n bytes (n <= 2^30) of rank 0's buf to every rank. */
    moe_status (*bcast)(void *ctx, void *buf, size_t n, moe_error *err);
    /* Before the first run: plug the parallel MoE into *o for the blocks of
     * layers first .. o->last_layer (and o->mtp's). Status agreed. */
    moe_status (*attach)(void *ctx, moe_fwd *f, moe_fwd_opts *o, int first, moe_error *err);
    /* After every moe_fwd_run, with its status: returns the agreed one. */
    moe_status (*settle)(void *ctx, moe_status st, moe_error *err);
    /* After a successful run: the parallel summary, collective; printed on
     * text by rank 0 (text NULL elsewhere and with --quiet). */
    void (*report)(void *ctx, moe_fwd *f, FILE *text);
    /* Before the model is freed: drop what attach opened (every rank). */
    void (*release)(void *ctx);
} moe_cli_fwd_par;

/* forward's body: one process (par NULL) or every rank of a parallel run. */
typedef int (*moe_cli_fwd_body)(const moe_cli_fwd_args *a, const moe_cli_fwd_par *par);
int moe_forward_run(const moe_cli_fwd_args *a, const moe_cli_fwd_par *par);
/* --ep: starts MPI and runs `body` (the command's, handed in so that the
 * driver does not call back into the command) on every rank with the
 * parallel hooks; exit 2 without MPI support. */
int moe_forward_ep(const moe_cli_fwd_args *a, moe_cli_fwd_body body);

#endif
