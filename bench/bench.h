/* `moeaudit bench`: routed-expert timing with its own floors (docs/performance.md). */
#ifndef MOE_BENCH_H
#define MOE_BENCH_H

#include "moeaudit.h"

/* Parse argv (argv[0] is "bench"), run, print the table to stdout and
 * optionally write JSON. isa: the kernels when --isa is not given (the
 * CLI's default, from MOE_ISA). Returns a process exit code (0 ok,
 * 1 failure, 2 usage). */
int moe_bench_main(int argc, char **argv, moe_isa isa);

#endif
