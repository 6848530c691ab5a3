/* `moeaudit bench`: routed-expert timing with its own floors (BENCHMARKING.md). */
#ifndef MOE_BENCH_H
#define MOE_BENCH_H

/* Parse argv (argv[0] is "bench"), run, print the table to stdout and
 * optionally write JSON. Returns a process exit code (0 ok, 1 failure,
 * 2 usage). */
int moe_bench_main(int argc, char **argv);

/* `moeaudit bench --linear` (bench/bench_linear.c): the dense linears of a
 * V4-Flash layer, float64 and float32, against floors of the same run. */
int moe_bench_linear_main(int argc, char **argv);

/* `moeaudit bench --layer` (bench/bench_linear.c): what one V4-Flash layer
 * costs on a T-token prompt, as measured unit costs times exact counts. */
int moe_bench_layer_main(int argc, char **argv);

/* `moeaudit bench --write-v4flash DIR` (bench/synth_v4flash.c): a synthetic
 * checkpoint in the V4-Flash release layout at full shapes, for timing the
 * whole-model forward. */
int moe_bench_write_v4flash_main(int argc, char **argv);

/* The streaming read bandwidth in bytes/s (1 GiB, all threads, best of 5
 * repetitions x 3 prefetch distances; AVX-512 loads where the CPU has them). */
double moe_bench_read_bandwidth(void);

#endif
