/* `moeaudit bench`: routed-expert timing with its own floors (BENCHMARKING.md). */
#ifndef MOE_BENCH_H
#define MOE_BENCH_H

/* Parse argv (argv[0] is "bench"), run, print the table to stdout and
 * optionally write JSON. Returns a process exit code (0 ok, 1 failure,
 * 2 usage). */
int moe_bench_main(int argc, char **argv);

#endif
