/* bench/amx_parts: the AMX kernel, v5 with K blocks of 32 steps (the
 * panels, 2 x 64 KiB, live in L2). */
#define AMX_PARTS_V(x) x##_v10
#define MOE_AMX_KB 32
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 2
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
