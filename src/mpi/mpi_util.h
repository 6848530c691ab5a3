/* Internal helpers of the MPI module: status agreement and MPI error text. */
#ifndef MOE_MPI_UTIL_H
#define MOE_MPI_UTIL_H

#include "moeaudit_mpi.h"

/* moe_mpi_agree is public (moeaudit_mpi.h). */

/* Fill err with "<what> failed: <MPI error string>" and return MOE_ERR_IO. */
moe_status moe_mpi_fail(moe_error *err, int rc, const char *what);

/* COLLECTIVE. True on every rank when v is the same on every rank. */
moe_status moe_mpi_same_u64(MPI_Comm comm, uint64_t v, bool *same, moe_error *err);

#endif
