/*
 * MPI helpers shared by expert parallelism and the layer-parallel gather.
 *
 * Invariants:
 *  1. A rank that fails locally keeps calling the same sequence of
 *     collectives as the others until the next moe_mpi_agree, which is where
 *     every rank learns the failure; so no rank waits forever on a failed one.
 *  2. Every rank leaves moe_mpi_agree with the same status and message.
 */
#include "core/core.h"
#include "mpi/mpi_util.h"

#include <string.h>

void moe_mpi_split(int64_t n, int parts, int part, int64_t *begin, int64_t *count) {
    MOE_ASSERT(parts > 0 && part >= 0 && part < parts && n >= 0);
    int64_t base = n / parts, rem = n % parts;
    *begin = part * base + (part < rem ? part : rem);
    *count = base + (part < rem ? 1 : 0);
}

moe_status moe_mpi_fail(moe_error *err, int rc, const char *what) {
    char s[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, s, &len) != MPI_SUCCESS) snprintf(s, sizeof s, "MPI error %d", rc);
    return moe_errf(err, MOE_ERR_IO, "%s failed: %s", what, s);
}

typedef struct agree_msg {
    int status;
    char msg[sizeof(((moe_error *)0)->msg)];
} agree_msg;

moe_status moe_mpi_agree(MPI_Comm comm, moe_status st, moe_error *err) {
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    int bad = st != MOE_OK ? rank : size, first = size;
    int rc = MPI_Allreduce(&bad, &first, 1, MPI_INT, MPI_MIN, comm);
    if (rc != MPI_SUCCESS) return moe_mpi_fail(err, rc, "MPI_Allreduce (status agreement)");
    if (first == size) return MOE_OK;
    agree_msg m;
    memset(&m, 0, sizeof m);
    if (rank == first) {
        m.status = (int)st;
        snprintf(m.msg, sizeof m.msg, "rank %d: %.490s", rank, err ? err->msg : "(no message)");
    }
    rc = MPI_Bcast(&m, (int)sizeof m, MPI_BYTE, first, comm);
    if (rc != MPI_SUCCESS) return moe_mpi_fail(err, rc, "MPI_Bcast (status agreement)");
    if (err) memcpy(err->msg, m.msg, sizeof err->msg);
    return (moe_status)m.status;
}

moe_status moe_mpi_same_u64(MPI_Comm comm, uint64_t v, bool *same, moe_error *err) {
    /* max(v) and max(~v) = ~min(v) in one reduction */
    uint64_t in[2] = {v, ~v}, out[2] = {0, 0};
    int rc = MPI_Allreduce(in, out, 2, MPI_UINT64_T, MPI_MAX, comm);
    if (rc != MPI_SUCCESS) return moe_mpi_fail(err, rc, "MPI_Allreduce (consistency check)");
    *same = out[0] == ~out[1];
    return MOE_OK;
}
