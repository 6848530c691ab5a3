/* The CLI's MPI helpers (tools/cmd_ep.c), for the --ep commands of MPI
 * builds: included only where MOE_HAVE_MPI is defined. */
#ifndef MOE_CLI_MPI_H
#define MOE_CLI_MPI_H

#include "moeaudit_mpi.h"

/* Start MPI unless the caller did (*inited says whether we did) and check
 * --ep against the process count (rank 0 says what is wrong). Exit code. */
int moe_cli_mpi_start(const char *cmd, long ep, bool *inited, int *rank, int *size);
/* Every rank leaves with rank 0's exit code; MPI_Finalize when we started it. */
int moe_cli_mpi_finish(int rc, bool inited);
/* The placement of E experts over N ranks: contiguous without a path, else
 * rank 0 reads the file and broadcasts it (status agreed). */
moe_status moe_cli_ep_placement(const char *path, int E, int N, int rank, moe_ep_placement *pl, moe_error *err);

#endif
