/* `moeaudit forward` (tools/cmd_forward.c): the whole DeepSeek-V4 model. */
#ifndef MOE_CMD_FORWARD_H
#define MOE_CMD_FORWARD_H

/* argv[0] = "forward". Returns an exit code: 0 ok, 1 failure, 2 usage or input error. */
int moe_cmd_forward(int argc, char **argv);

#endif
