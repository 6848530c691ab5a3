/* Entry points of the hyper-connection and indexer commands (tools/cmd_hc.c,
 * tools/cmd_needle.c). Each returns an exit code: 0 ok, 1 failure, 2 usage
 * or input error. */
#ifndef MOE_CMD_EXTRA_H
#define MOE_CMD_EXTRA_H

/* `moeaudit run --block hc_ffn|hc_attn ...`: gets run's full argv (argv[0] = "run"). */
int moe_cmd_run_hc(int argc, char **argv);
/* `moeaudit needle ...` (argv[0] = "needle"). */
int moe_cmd_needle(int argc, char **argv);
/* `moeaudit bisect ...` (argv[0] = "bisect"): tools/cmd_bisect.c. */
int moe_cmd_bisect(int argc, char **argv);

#endif
