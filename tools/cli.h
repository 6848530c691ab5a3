/* The CLI's shared helpers and the commands' entry points. Each command
 * lives in tools/cmd_<name>.c (or moeaudit.c) and returns an exit code. */
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include "moeaudit.h"

enum { EXIT_OKAY = 0, EXIT_FAIL = 1, EXIT_USAGE = 2 };

/* Exit code for a library status: 2 for statuses that mean the input (files,
 * flags) is wrong, 1 otherwise. */
int moe_cli_exit_code(moe_status s);
/* Print "moeaudit: <status>: <message>" and return its exit code. */
int moe_cli_fail(moe_status s, const moe_error *err);
/* Print a usage error for `cmd` (fmt takes one string) and return 2. */
int moe_cli_usage(const char *cmd, const char *fmt, const char *arg);
bool moe_cli_parse_int(const char *s, long lo, long hi, long *out);
/* The CLI's default CPU kernels: MOE_ISA from the environment (unset or
 * empty: auto). An unknown or unavailable value is printed with what is
 * available and returns 2; else *isa is set and 0 returned. */
int moe_cli_isa_default(moe_isa *isa);

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
void moe_cli_input_free(moe_cli_input *in);

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
 * is set (saying so on stdout, or the error on stderr), then free them.
 * Returns the exit code. */
int moe_cli_writer_finish(moe_cli_writer *w, const char *path, int rc);
void moe_cli_writer_free(moe_cli_writer *w);

/* Commands (tools/cmd_<name>.c). */
int moe_cmd_quantize(int argc, char **argv);
int moe_cmd_diagnose(int argc, char **argv);
int moe_cmd_audit(int argc, char **argv);

#endif
