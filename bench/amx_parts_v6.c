/* bench/amx_parts: the AMX kernel, v5 with the 2 x 2 step's products B-major and the next tiles loaded as freed. */
#define AMX_PARTS_V(x) x##_v6
#define MOE_AMX_KB 8
#define MOE_AMX_PACK_T 1
#define MOE_AMX_DSPLIT 2
#define MOE_AMX_TPIPE 1
#define MOE_AMX_BSTREAM 0
#include "amx_parts_kernel.h"
