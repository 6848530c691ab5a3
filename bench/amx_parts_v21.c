/* bench/amx_parts: the AMX kernel, v18 (K blocks of 8, B by TILELOADDT1) with
 * the weights' prefetch into L2 (T1). */
#define AMX_PARTS_V(x) x##_v21
#define MOE_AMX_KB 8
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 2
#define MOE_AMX_TPIPE 0
#define MOE_AMX_BSTREAM 1
#define MOE_AMX_PFW 2
#include "amx_parts_kernel.h"
