/* The CLI's GPU commands (tools/cmd_cuda.c). Without CUDA support built in
 * they print an error and return 2. */
#ifndef MOE_CMD_CUDA_H
#define MOE_CMD_CUDA_H

/* `moeaudit run --device cuda ...`: argv is run's full argv (argv[0] = "run");
 * the options of run (--model --layer --input --output --precision/--act
 * --scale-owner --fuse-shared --check --tokens) plus --compare (report the
 * error against the CPU float64 reference with the same activation rounding)
 * and --path auto|gemv|mma. Writes the same output tensors as run (F32). */
int moe_cmd_run_cuda(int argc, char **argv);

/* `moeaudit bench --device cuda ...` (argv[0] = "bench"): the routed experts
 * on the GPU with the floors measured in the same run and torch's
 * _grouped_mm as the peer. */
int moe_cmd_bench_cuda(int argc, char **argv);

#endif
