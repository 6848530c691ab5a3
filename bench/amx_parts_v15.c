/* bench/amx_parts: the AMX kernel, v14 with K blocks of 128 steps (4096
 * columns: one K block per row block, the C tiles never staged; the panels,
 * 2 x 256 KiB, live in L2). */
#define AMX_PARTS_V(x) x##_v15
#define MOE_AMX_KB 128
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 3
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
