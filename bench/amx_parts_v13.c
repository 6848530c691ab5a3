/* bench/amx_parts: the AMX kernel, v8 without the weights' software prefetch. */
#define AMX_PARTS_V(x) x##_v13
#define MOE_AMX_KB 16
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 2
#define MOE_AMX_TPIPE 0
#define MOE_AMX_PFW 0
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
