/* The CLI's MPI commands (tools/cmd_ep.c). Without MPI support built in they
 * print an error and return 2. They call MPI_Init and MPI_Finalize
 * themselves; nothing else in the CLI touches MPI. */
#ifndef MOE_CMD_MPI_H
#define MOE_CMD_MPI_H

/* `moeaudit run --ep N ...`: argv is run's full argv (argv[0] = "run"); the
 * options of run plus --ep N (must equal the number of MPI processes) and
 * --placement FILE. Writes the same output file as the single-process run. */
int moe_cmd_run_ep(int argc, char **argv);

/* `moeaudit bench --ep N ...` (argv[0] = "bench"): dispatch, expert compute
 * and combine times and the bytes moved per token. */
int moe_cmd_bench_ep(int argc, char **argv);

/* `mpirun -np N moeaudit forward --ep N [--placement FILE] ...` (argv[0] =
 * "forward", tools/cmd_forward_ep.c): the whole-model forward with every
 * layer's routed experts split over the ranks; the same output bytes as the
 * single-process forward. */
int moe_cmd_forward_ep(int argc, char **argv);

#endif
