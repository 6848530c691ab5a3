/* bench/amx_parts: the builds of the AMX kernel it times side by side
 * (bench/amx_parts_v*.c, each src/cpu/amx/gemm_amx.c with its compile-time
 * variants set otherwise; bench/amx_parts_kernel.h says how). */
#ifndef MOE_BENCH_AMX_PARTS_H
#define MOE_BENCH_AMX_PARTS_H

#include "cpu/kernels.h"
#include "experts/experts_fast.h"

/* One build's entry points:
 *   amx_parts_table_<v>()  its kernel table (NULL: the compiler has no AMX)
 *   amx_parts_pack_<v>     the activations X [n, ldx] packed into B tiles in
 *                          ws (bf16act_ws(w, n) bytes of a weight with `cols`
 *                          columns), as one kernel call does
 *   amx_parts_decode_<v>   rows r0 .. r1 of an MXFP4 weight decoded into the
 *                          panels of ws (bf16act_ws(w, 32) bytes), every K
 *                          block, as the kernel does, without the tiles */
#define AMX_PARTS_DECLARE(v)                                                                                    \
    const moe_cpu_kernels *amx_parts_table_##v(void);                                                           \
    void amx_parts_pack_##v(const float *X, int64_t ldx, int64_t n, int64_t cols, void *ws);                    \
    void amx_parts_decode_##v(const moe_weight *w, int64_t r0, int64_t r1, void *ws);

AMX_PARTS_DECLARE(v0) /* the kernel before issue #18's breakdown: MOE_AMX_KB 8, PACK_T 0, DSPLIT 0, TPIPE 0 */
AMX_PARTS_DECLARE(v1) /* PACK_T 1 */
AMX_PARTS_DECLARE(v2) /* PACK_T 1, DSPLIT 1 */
AMX_PARTS_DECLARE(v3) /* PACK_T 1, DSPLIT 1, KB 16 */
AMX_PARTS_DECLARE(v4) /* PACK_T 1, KB 16 */
AMX_PARTS_DECLARE(v5) /* PACK_T 1, DSPLIT 2 */
AMX_PARTS_DECLARE(v6) /* PACK_T 1, DSPLIT 2, TPIPE 1 */
AMX_PARTS_DECLARE(v7) /* PACK_T 1, DSPLIT 2, TPIPE 2 */
AMX_PARTS_DECLARE(v8) /* PACK_T 1, DSPLIT 2, KB 16 */
AMX_PARTS_DECLARE(v9) /* PACK_T 1, DSPLIT 2, TPIPE 1, KB 16 */
AMX_PARTS_DECLARE(v10) /* PACK_T 1, DSPLIT 2, KB 32 */
AMX_PARTS_DECLARE(v11) /* PACK_T 1, DSPLIT 2, TPIPE 1, KB 32 */
AMX_PARTS_DECLARE(v12) /* PACK_T 1, DSPLIT 2, KB 16, PFW 2 (weights prefetched into L2) */
AMX_PARTS_DECLARE(v13) /* PACK_T 1, DSPLIT 2, KB 16, PFW 0 (no software prefetch of the weights) */
AMX_PARTS_DECLARE(v14) /* PACK_T 1, DSPLIT 3, KB 16 (the decode in chunk runs, pipelined across row blocks) */
AMX_PARTS_DECLARE(v15) /* PACK_T 1, DSPLIT 3, KB 128 (C never staged at 4096 columns) */
AMX_PARTS_DECLARE(v16) /* v8 + BSTREAM 1 (the B tiles by TILELOADDT1) */
AMX_PARTS_DECLARE(v17) /* v15 + BSTREAM 1 */
AMX_PARTS_DECLARE(v18) /* v16 + KB 8 */
AMX_PARTS_DECLARE(v19) /* v16 + KB 32 */
AMX_PARTS_DECLARE(v20) /* v16 + PFW 2 */
AMX_PARTS_DECLARE(v21) /* v18 + PFW 2 */
AMX_PARTS_DECLARE(nd) /* v2 without the decode's arithmetic (AMX_PARTS_NO_DECODE) */

/* The experts driver (src/experts/experts_fast.c, moe_experts_fast's
 * contract) built with each MOE_EXPERTS_CLAIM (bench/amx_parts_drv_*.c):
 * static = invariant 4 always, claim = invariant 5 on the amx table. */
typedef void (*amx_parts_driver)(const moe_cpu_kernels *k, double limit, moe_act_prec act, const moe_expert_job *jobs,
                                 int njobs, void *scratch, int nthreads);
void amx_parts_experts_static(const moe_cpu_kernels *k, double limit, moe_act_prec act, const moe_expert_job *jobs,
                              int njobs, void *scratch, int nthreads);
void amx_parts_experts_claim(const moe_cpu_kernels *k, double limit, moe_act_prec act, const moe_expert_job *jobs,
                             int njobs, void *scratch, int nthreads);

#endif
