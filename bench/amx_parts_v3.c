/* bench/amx_parts: the AMX kernel, as v2 with K blocks of 16 steps. */
#define AMX_PARTS_V(x) x##_v3
#define MOE_AMX_KB 16
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 1
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
