/* bench/amx_parts: the AMX kernel, v16 with K blocks of 32. */
#define AMX_PARTS_V(x) x##_v19
#define MOE_AMX_KB 32
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 2
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 1
#include "amx_parts_kernel.h"
